//! DTensor placements against torch 2.15 (fixtures from tests/data/placement/generate.py),
//! the worked examples of the design notes, copy/gather round trips, and the C ABI.

// One-element Vecs of Ranges are the slices of 1-D tensors here, not mistakes.
#![allow(clippy::single_range_in_vec_init)]

use std::ffi::c_void;
use std::ops::Range;

use fsdpturbo::error::ErrorKind;
use fsdpturbo::ffi::placement::*;
use fsdpturbo::ffi::status::*;
use fsdpturbo::placement::{
    CopyPlan, Placement, Run, copy_plan, copy_runs_bytes, gather_plan, local_shape_and_offset,
    scatter_runs_bytes, seed_copy_slices,
};
use serde_json::Value;

use Placement::{Partial, Replicate, Shard};

mod common;
use common::{Rng, last_error};

fn ss(dim: usize, split_factor: u64) -> Placement {
    Placement::StridedShard { dim, split_factor }
}

// --- fixture parsing ---------------------------------------------------------------------

fn fixture() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/placement/torch_cases.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture exists")).expect("fixture is JSON")
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("u64")).collect()
}

fn placement(s: &str) -> Placement {
    match s {
        "R" => Replicate,
        "P" => Partial,
        _ if s.starts_with("SS(") => {
            let (d, f) = s[3..s.len() - 1].split_once(',').expect("SS(d,f)");
            ss(d.parse().unwrap(), f.parse().unwrap())
        }
        _ if s.starts_with("S(") => Shard(s[2..s.len() - 1].parse().unwrap()),
        _ => panic!("unknown placement {s}"),
    }
}

fn placements(v: &Value) -> Vec<Placement> {
    v.as_array().unwrap().iter().map(|p| placement(p.as_str().unwrap())).collect()
}

fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

/// The global linear indices of a local tensor whose dim d holds global rows `index[d]`.
fn outer_product(global_shape: &[u64], index: &[Vec<u64>]) -> Vec<u64> {
    let mut out = vec![0u64];
    for (d, rows) in index.iter().enumerate() {
        let mut next = Vec::with_capacity(out.len() * rows.len());
        for &base in &out {
            for &r in rows {
                next.push(base * global_shape[d] + r);
            }
        }
        out = next;
    }
    out
}

fn iota(n: u64) -> Vec<u64> {
    (0..n).collect()
}

/// Runs must tile the local tensor in order and be maximal (no two neighbours mergeable).
fn check_runs(plan: &CopyPlan) {
    let mut dst = 0;
    for (k, r) in plan.runs.iter().enumerate() {
        assert!(r.len > 0, "empty run in {plan:?}");
        assert_eq!(r.dst, dst, "runs do not tile the local tensor: {plan:?}");
        assert!(r.src + r.len <= numel(&plan.global_shape));
        if k > 0 {
            let p = &plan.runs[k - 1];
            assert_ne!(p.src + p.len, r.src, "runs {} and {k} could be one: {plan:?}", k - 1);
        }
        dst += r.len;
    }
    assert_eq!(dst, plan.local_numel());
}

// --- torch oracle --------------------------------------------------------------------------

#[test]
fn fixture_is_torch_2_15_and_large_enough() {
    let f = fixture();
    assert!(f["torch_version"].as_str().unwrap().starts_with("2.15."));
    assert!(f["cases"].as_array().unwrap().len() >= 2000);
    assert!(!f["errors"].as_array().unwrap().is_empty());
    assert!(f["mappings"].as_array().unwrap().len() >= 200);
}

#[test]
fn local_shape_offset_and_element_mapping_match_torch() {
    let f = fixture();
    let (mut strided, mut empty, mut uneven_nested) = (0, 0, 0);
    for (n, case) in f["cases"].as_array().unwrap().iter().enumerate() {
        let c = case.as_array().unwrap();
        let (global, mesh, coord, pls) = (u64s(&c[0]), u64s(&c[1]), u64s(&c[2]), placements(&c[3]));
        let (want_shape, want_offset) = (u64s(&c[4]), u64s(&c[5]));
        let ctx = format!("case {n}: global {global:?} mesh {mesh:?} coord {coord:?} {pls:?}");

        let (shape, offset) = local_shape_and_offset(&global, &mesh, &coord, &pls).expect(&ctx);
        assert_eq!((&shape, &offset), (&want_shape, &want_offset), "{ctx}");

        // torch's index list of every sharded dim; the other dims are whole.
        let mut index: Vec<Vec<u64>> = global.iter().map(|&g| iota(g)).collect();
        for (dim, segs) in c[6].as_object().unwrap() {
            let d: usize = dim.parse().unwrap();
            index[d] = segs
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|s| {
                    let s = u64s(s);
                    s[0]..s[0] + s[1]
                })
                .collect();
            assert_eq!(index[d].len() as u64, shape[d], "{ctx}: dim {d}");
        }
        let expected = outer_product(&global, &index);

        // Partial moves no elements: copy_plan refuses it; its element mapping is Replicate's.
        let has_partial = pls.contains(&Partial);
        if has_partial {
            let err = copy_plan(&global, &mesh, &coord, &pls).unwrap_err();
            assert_eq!(err.kind, ErrorKind::InvalidArgument);
            assert!(err.message.contains("Partial()"), "{}", err.message);
        }
        let pls_r: Vec<Placement> = pls.iter().map(|p| if *p == Partial { Replicate } else { *p }).collect();
        let plan = copy_plan(&global, &mesh, &coord, &pls_r).expect(&ctx);
        assert_eq!(plan.local_shape, shape, "{ctx}");
        check_runs(&plan);
        let full = iota(numel(&global));
        let mut local = vec![u64::MAX; plan.local_numel() as usize];
        plan.apply(&full, &mut local).unwrap();
        assert_eq!(local, expected, "{ctx}: element mapping");

        strided += pls.iter().any(|p| matches!(p, Placement::StridedShard { .. })) as u32;
        empty += shape.contains(&0) as u32;
        let mut seen = std::collections::HashSet::new();
        uneven_nested += pls.iter().filter_map(|p| p.shard_dim()).any(|d| !seen.insert(d)) as u32
            & (!shape.contains(&0)) as u32;
    }
    // The draw covers what the brief asks for.
    assert!(strided > 500 && empty > 200 && uneven_nested > 300, "{strided} {empty} {uneven_nested}");
}

#[test]
fn torch_errors_are_errors_here() {
    let f = fixture();
    for case in f["errors"].as_array().unwrap() {
        let c = case.as_array().unwrap();
        let (global, mesh, coord, pls) = (u64s(&c[0]), u64s(&c[1]), u64s(&c[2]), placements(&c[3]));
        let torch_error = c[4].as_str().unwrap();
        let err = local_shape_and_offset(&global, &mesh, &coord, &pls)
            .expect_err(&format!("torch raised {torch_error} for {global:?} {mesh:?} {pls:?}"));
        assert_eq!(err.kind, ErrorKind::InvalidArgument);
        assert!(
            err.message.contains("`placements[") || err.message.contains("`mesh_shape["),
            "{}",
            err.message
        );
        assert!(copy_plan(&global, &mesh, &coord, &pls).is_err());
        assert!(seed_copy_slices(&global, &mesh, &coord, &pls).is_err());
        assert!(gather_plan(&global, &mesh, &pls).is_err());
    }
}

/// torch's real data movement (distribute_tensor in LocalTensorMode): every rank's local
/// tensor, element by element, and the gather of those locals.
#[test]
fn copy_plans_match_torch_distribute_tensor_and_gather_inverts_it() {
    let f = fixture();
    let mut strided = 0;
    for (n, case) in f["mappings"].as_array().unwrap().iter().enumerate() {
        let c = case.as_array().unwrap();
        let (global, mesh, pls) = (u64s(&c[0]), u64s(&c[1]), placements(&c[2]));
        let ctx = format!("mapping {n}: global {global:?} mesh {mesh:?} {pls:?}");
        let ranks = c[3].as_array().unwrap();
        assert_eq!(ranks.len() as u64, numel(&mesh), "{ctx}");
        let full = iota(numel(&global));
        let mut torch_locals: Vec<Vec<u64>> = Vec::new();
        for (r, rank) in ranks.iter().enumerate() {
            let rk = rank.as_array().unwrap();
            let (coord, shape, values) = (u64s(&rk[0]), u64s(&rk[1]), u64s(&rk[2]));
            let plan = copy_plan(&global, &mesh, &coord, &pls).expect(&ctx);
            assert_eq!(plan.local_shape, shape, "{ctx}: rank {r} {coord:?}");
            let mut local = vec![u64::MAX; plan.local_numel() as usize];
            plan.apply(&full, &mut local).unwrap();
            assert_eq!(local, values, "{ctx}: rank {r} {coord:?}");
            torch_locals.push(values);
        }
        let gp = gather_plan(&global, &mesh, &pls).expect(&ctx);
        let locals: Vec<&[u64]> = torch_locals.iter().map(Vec::as_slice).collect();
        let mut out = vec![u64::MAX; full.len()];
        gp.gather(&locals, &mut out).unwrap();
        assert_eq!(out, full, "{ctx}: gather");
        strided += pls.iter().any(|p| matches!(p, Placement::StridedShard { .. })) as u32;
    }
    assert!(strided >= 80, "{strided}");
}

// --- worked examples -----------------------------------------------------------------------

fn torch(global: &[u64], mesh: &[u64], coord: &[u64], pls: &[Placement]) -> (Vec<u64>, Vec<u64>) {
    local_shape_and_offset(global, mesh, coord, pls).unwrap()
}

fn seed(global: &[u64], mesh: &[u64], coord: &[u64], pls: &[Placement]) -> Option<Vec<Range<u64>>> {
    seed_copy_slices(global, mesh, coord, pls).unwrap()
}

#[test]
fn build_notes_section_6_table() {
    let s0 = [Shard(0)];
    let want: [(&[u64], &[u64]); 4] = [(&[3], &[0]), (&[3], &[3]), (&[3], &[6]), (&[1], &[9])];
    for (i, (shape, off)) in want.iter().enumerate() {
        assert_eq!(torch(&[10], &[4], &[i as u64], &s0), (shape.to_vec(), off.to_vec()));
    }
    // (10,) on mesh (2,3) [Shard(0), Shard(0)]: 10 -> 5,5 -> 2,2,1 each.
    let nested = [Shard(0), Shard(0)];
    let want = [[(2, 0), (2, 2), (1, 4)], [(2, 5), (2, 7), (1, 9)]];
    for (a, row) in want.iter().enumerate() {
        for (b, &(sz, off)) in row.iter().enumerate() {
            let (a, b) = (a as u64, b as u64);
            assert_eq!(torch(&[10], &[2, 3], &[a, b], &nested), (vec![sz], vec![off]));
        }
    }
    // (5,7) on mesh (2,3) [Shard(0), Shard(1)].
    let two = [Shard(0), Shard(1)];
    let want = [
        [((3, 3), (0, 0)), ((3, 3), (0, 3)), ((3, 1), (0, 6))],
        [((2, 3), (3, 0)), ((2, 3), (3, 3)), ((2, 1), (3, 6))],
    ];
    for (a, row) in want.iter().enumerate() {
        for (b, &((s0, s1), (o0, o1))) in row.iter().enumerate() {
            let (a, b) = (a as u64, b as u64);
            assert_eq!(torch(&[5, 7], &[2, 3], &[a, b], &two), (vec![s0, s1], vec![o0, o1]));
        }
    }
    // (3,) over 4: the empty shard's offset is the dim size, not 0.
    for k in 0..3 {
        assert_eq!(torch(&[3], &[4], &[k], &s0), (vec![1], vec![k]));
    }
    assert_eq!(torch(&[3], &[4], &[3], &s0), (vec![0], vec![3]));
}

#[test]
fn seed_section_8_ceil_chunking_10_9_2_over_4() {
    let s0 = [Shard(0)];
    // 10 over 4: both semantics give [0:3] [3:6] [6:9] [9:10].
    for (i, r) in [0..3, 3..6, 6..9, 9..10].into_iter().enumerate() {
        let i = i as u64;
        assert_eq!(seed(&[10], &[4], &[i], &s0), Some(vec![r.clone()]));
        assert_eq!(torch(&[10], &[4], &[i], &s0), (vec![r.end - r.start], vec![r.start]));
    }
    // 9 over 4: chunk 3, the last rank is empty. torch: size 0 at offset 9; the seed copies nothing.
    assert_eq!(seed(&[9], &[4], &[2], &s0), Some(vec![6..9]));
    assert_eq!(seed(&[9], &[4], &[3], &s0), None);
    assert_eq!(torch(&[9], &[4], &[3], &s0), (vec![0], vec![9]));
    // 2 over 4: ranks 2 and 3 are empty.
    assert_eq!(seed(&[2], &[4], &[1], &s0), Some(vec![1..2]));
    for i in [2, 3] {
        assert_eq!(seed(&[2], &[4], &[i], &s0), None);
        assert_eq!(torch(&[2], &[4], &[i], &s0), (vec![0], vec![2]));
        let plan = copy_plan(&[2], &[4], &[i], &s0).unwrap();
        assert_eq!((plan.local_shape.clone(), plan.runs.len()), (vec![0], 0));
    }
    // Nested empty shard: torch reports the *global* size (10), not the current size (5).
    assert_eq!(torch(&[10], &[2, 4], &[0, 3], &[Shard(0), Shard(0)]), (vec![0], vec![10]));
    assert_eq!(seed(&[10], &[2, 4], &[0, 3], &[Shard(0), Shard(0)]), None);
    // Replicate / Partial only: the seed copies the whole tensor.
    assert_eq!(seed(&[4, 5], &[3], &[2], &[Replicate]), Some(vec![0..4, 0..5]));
    assert_eq!(seed(&[4, 5], &[3], &[2], &[Partial]), Some(vec![0..4, 0..5]));
}

#[test]
fn expert_weights_on_efsdp_ep_mesh_agree_in_both_semantics() {
    // gate_up_proj [E=8, 2I=10, H=4] on mesh (efsdp=4, ep=2): Shard(1) on efsdp, Shard(0) on ep.
    let (global, mesh, pls) = ([8, 10, 4], [4, 2], [Shard(1), Shard(0)]);
    let rows = [0..3, 3..6, 6..9, 9..10];
    for f in 0..4u64 {
        for e in 0..2u64 {
            let want = vec![e * 4..e * 4 + 4, rows[f as usize].clone(), 0..4];
            assert_eq!(seed(&global, &mesh, &[f, e], &pls), Some(want.clone()));
            let (shape, off) = torch(&global, &mesh, &[f, e], &pls);
            let torch_ranges: Vec<Range<u64>> = shape.iter().zip(&off).map(|(&s, &o)| o..o + s).collect();
            assert_eq!(torch_ranges, want);
            // Rows of 4 elements, contiguous along H: one run per (expert, out-row block).
            let plan = copy_plan(&global, &mesh, &[f, e], &pls).unwrap();
            assert_eq!(plan.runs.len(), 4);
            assert_eq!(
                plan.runs[0],
                Run { src: e * 4 * 40 + rows[f as usize].start * 4, dst: 0, len: shape[1] * 4 }
            );
        }
    }
    // 9 out-rows over efsdp 4: the last efsdp rank is empty; torch: size 0, offset 9; seed: nothing.
    assert_eq!(torch(&[8, 9, 4], &mesh, &[3, 1], &pls), (vec![4, 0, 4], vec![4, 9, 0]));
    assert_eq!(seed(&[8, 9, 4], &mesh, &[3, 1], &pls), None);
}

#[test]
fn strided_shard_of_a_1d_expert_param_differs_from_the_seed() {
    // A 1-D per-expert tensor [8] sharded by EP (Shard(0) on ep) and then by FSDP2 on the same
    // dim: placements on (efsdp=2, ep=2) are [_StridedShard(0, sf=2), Shard(0)] (torch's
    // docstring example): torch interleaves, the seed chunks plainly.
    let (global, mesh, pls) = ([8], [2, 2], [ss(0, 2), Shard(0)]);
    let torch_rows = [[0..2, 4..6], [2..4, 6..8]];
    let seed_rows = [[0..2, 2..4], [4..6, 6..8]];
    for f in 0..2u64 {
        for e in 0..2u64 {
            let (t, s) = (&torch_rows[f as usize][e as usize], &seed_rows[f as usize][e as usize]);
            assert_eq!(torch(&global, &mesh, &[f, e], &pls), (vec![2], vec![t.start]));
            assert_eq!(seed(&global, &mesh, &[f, e], &pls), Some(vec![s.clone()]));
            let plan = copy_plan(&global, &mesh, &[f, e], &pls).unwrap();
            assert_eq!(plan.runs, vec![Run { src: t.start, dst: 0, len: 2 }]);
        }
    }
    // Uneven: [10, 3] (docstring-style), rows per coordinate from torch: (0,0) 0-2, (0,1) 5-7,
    // (1,0) 3-4, (1,1) 8-9. The strided level alone gives non-contiguous rows.
    let (global, pls) = ([10, 3], [ss(0, 2), Shard(0)]);
    for (coord, rows) in [([0, 0], 0..3), ([0, 1], 5..8), ([1, 0], 3..5), ([1, 1], 8..10)] {
        let plan = copy_plan(&global, &mesh, &coord, &pls).unwrap();
        assert_eq!(plan.runs, vec![Run { src: rows.start * 3, dst: 0, len: (rows.end - rows.start) * 3 }]);
    }
    let plan = copy_plan(&global, &[2], &[0], &[ss(0, 2)]).unwrap();
    assert_eq!(plan.runs, vec![Run { src: 0, dst: 0, len: 9 }, Run { src: 15, dst: 9, len: 9 }]);
    // [9] with _StridedShard(0, sf=3) over 2: pieces 0-2, 3-5, 6-8; rank 0 keeps 0,1 3,4 6,7.
    let plan = copy_plan(&[9], &[2], &[0], &[ss(0, 3)]).unwrap();
    let starts: Vec<(u64, u64)> = plan.runs.iter().map(|r| (r.src, r.len)).collect();
    assert_eq!(starts, [(0, 2), (3, 2), (6, 2)]);
    assert_eq!(seed(&[9], &[2], &[0], &[ss(0, 3)]), Some(vec![0..5]));
}

// --- plans: run counts, round trips ---------------------------------------------------------

#[test]
fn run_counts() {
    let runs = |g: &[u64], m: &[u64], c: &[u64], p: &[Placement]| copy_plan(g, m, c, p).unwrap().runs.len();
    // A contiguous block is one run.
    assert_eq!(runs(&[12, 6, 5], &[4], &[1], &[Shard(0)]), 1);
    assert_eq!(runs(&[12, 6, 5], &[3], &[2], &[Replicate]), 1);
    assert_eq!(runs(&[12, 6, 5], &[2, 3], &[1, 2], &[Shard(0), Shard(0)]), 1);
    assert_eq!(runs(&[1, 6, 5], &[2], &[1], &[Shard(1)]), 1); // leading dim of 1
    assert_eq!(runs(&[], &[2], &[1], &[Replicate]), 1); // a scalar
    // One run per leading row otherwise.
    assert_eq!(runs(&[12, 6, 5], &[2], &[1], &[Shard(1)]), 12);
    assert_eq!(runs(&[12, 6, 5], &[5], &[0], &[Shard(2)]), 72);
    assert_eq!(runs(&[12, 6, 5], &[2, 5], &[0, 4], &[Shard(1), Shard(2)]), 36);
    // Empty shards and empty tensors have none.
    assert_eq!(runs(&[3, 4], &[4], &[3], &[Shard(0)]), 0);
    assert_eq!(runs(&[0, 4], &[2], &[0], &[Shard(1)]), 0);
    // Strided: one run per piece kept.
    assert_eq!(runs(&[16, 3], &[2], &[1], &[ss(0, 4)]), 4);
    assert_eq!(runs(&[16, 3], &[1], &[0], &[ss(0, 4)]), 1); // one rank keeps every piece
}

fn random_case(rng: &mut Rng) -> (Vec<u64>, Vec<u64>, Vec<Placement>) {
    let ndim = 1 + rng.below_u64(4) as usize;
    let mesh: Vec<u64> = (0..1 + rng.below_u64(3)).map(|_| 1 + rng.below_u64(4)).collect();
    let global: Vec<u64> =
        (0..ndim).map(|_| if rng.below_u64(12) == 0 { 0 } else { 1 + rng.below_u64(9) }).collect();
    let pls = mesh
        .iter()
        .map(|_| match rng.below_u64(4) {
            0 | 1 => Shard(rng.below_u64(ndim as u64) as usize),
            2 => ss(rng.below_u64(ndim as u64) as usize, 1 + rng.below_u64(4)),
            _ => Replicate,
        })
        .collect();
    (global, mesh, pls)
}

fn coordinates(mesh: &[u64]) -> Vec<Vec<u64>> {
    let mut out = vec![vec![]];
    for &m in mesh {
        out = out.into_iter().flat_map(|c| (0..m).map(move |i| [c.clone(), vec![i]].concat())).collect();
    }
    out
}

#[test]
fn scatter_then_gather_is_bitwise_over_random_cases() {
    let mut rng = Rng(0x5EED_0FD7);
    for n in 0..600 {
        let (global, mesh, pls) = random_case(&mut rng);
        let ctx = format!("case {n}: {global:?} {mesh:?} {pls:?}");
        // Random f32 bit patterns (NaN payloads, -0.0, subnormals) must come back bit for bit.
        let full: Vec<f32> = (0..numel(&global)).map(|_| f32::from_bits(rng.next_u64() as u32)).collect();
        let gp = gather_plan(&global, &mesh, &pls).expect(&ctx);
        let sources: Vec<(Vec<u64>, CopyPlan)> = gp.sources().map(|(c, p)| (c, p.clone())).collect();
        let mut locals = Vec::new();
        let mut covered = vec![0u32; full.len()];
        for coord in coordinates(&mesh) {
            let plan = copy_plan(&global, &mesh, &coord, &pls).expect(&ctx);
            check_runs(&plan);
            let (shape, _) = local_shape_and_offset(&global, &mesh, &coord, &pls).unwrap();
            assert_eq!(plan.local_shape, shape);
            let mut local = vec![0f32; plan.local_numel() as usize];
            plan.apply(&full, &mut local).unwrap();
            let replica = pls.iter().zip(&coord).any(|(p, &c)| *p == Replicate && c != 0);
            match sources.iter().find(|(c, _)| *c == coord) {
                Some((_, p)) => {
                    assert!(!replica, "{ctx}");
                    assert_eq!(*p, plan, "{ctx}");
                    for r in &plan.runs {
                        for x in &mut covered[r.src as usize..(r.src + r.len) as usize] {
                            *x += 1;
                        }
                    }
                }
                None => assert!(replica, "{ctx}: {coord:?} is neither a source nor a replica"),
            }
            // The byte kernel agrees with the element copy, for odd element sizes too.
            let elem = 4;
            let full_bytes: Vec<u8> = full.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
            let mut local_bytes = vec![0u8; local.len() * elem];
            copy_runs_bytes(&plan, elem, &full_bytes, &mut local_bytes).unwrap();
            let want: Vec<u8> = local.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
            assert_eq!(local_bytes, want, "{ctx}");
            let mut back = vec![0u8; full_bytes.len()];
            scatter_runs_bytes(&plan, elem, &local_bytes, &mut back).unwrap();
            for r in &plan.runs {
                let (a, b) = ((r.src as usize) * elem, ((r.src + r.len) as usize) * elem);
                assert_eq!(back[a..b], full_bytes[a..b]);
            }
            locals.push(local);
        }
        assert!(covered.iter().all(|&c| c == 1), "{ctx}: sources must cover every element exactly once");
        let refs: Vec<&[f32]> = locals.iter().map(Vec::as_slice).collect();
        let mut out = vec![0f32; full.len()];
        gp.gather(&refs, &mut out).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out), bits(&full), "{ctx}");
        // scatter_back of each local restores exactly its elements.
        let mut out2 = vec![f32::from_bits(0x7FC0_1234); full.len()];
        for (k, (_, plan)) in sources.iter().enumerate() {
            let rank = coordinates(&mesh).iter().position(|c| *c == sources[k].0).unwrap();
            plan.scatter_back(&locals[rank], &mut out2).unwrap();
        }
        assert_eq!(bits(&out2), bits(&full), "{ctx}");
    }
}

#[test]
fn seed_and_torch_agree_for_plain_shards_without_empty_levels() {
    let mut rng = Rng(42);
    let (mut same, mut empty) = (0, 0);
    for _ in 0..3000 {
        let (global, mesh, pls) = random_case(&mut rng);
        let pls: Vec<Placement> = pls
            .into_iter()
            .map(|p| if let Placement::StridedShard { dim, .. } = p { Shard(dim) } else { p })
            .collect();
        let coord: Vec<u64> = mesh.iter().map(|&m| rng.below_u64(m)).collect();
        let (shape, off) = local_shape_and_offset(&global, &mesh, &coord, &pls).unwrap();
        match seed_copy_slices(&global, &mesh, &coord, &pls).unwrap() {
            Some(slices) => {
                let torch_ranges: Vec<Range<u64>> = shape.iter().zip(&off).map(|(&s, &o)| o..o + s).collect();
                assert_eq!(slices, torch_ranges, "{global:?} {mesh:?} {coord:?} {pls:?}");
                same += 1;
            }
            // The seed stops at an empty level (or a dim of size 0); torch has an empty shard.
            None => {
                assert!(shape.contains(&0), "{global:?} {mesh:?} {coord:?} {pls:?}");
                empty += 1;
            }
        }
    }
    assert!(same > 1000 && empty > 300, "{same} {empty}");
}

#[test]
fn placement_display_and_serialize() {
    assert_eq!(Shard(1).to_string(), "Shard(dim=1)");
    assert_eq!(ss(0, 2).to_string(), "_StridedShard(dim=0, sf=2)");
    assert_eq!(Replicate.to_string(), "Replicate()");
    assert_eq!(Partial.to_string(), "Partial()");
    assert_eq!(
        serde_json::to_string(&[Shard(1), ss(0, 2)]).unwrap(),
        r#"[{"Shard":1},{"StridedShard":{"dim":0,"split_factor":2}}]"#
    );
}

// --- errors --------------------------------------------------------------------------------

fn err_of<T: std::fmt::Debug>(r: fsdpturbo::error::Result<T>) -> String {
    let e = r.unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{}", e.message);
    e.message
}

#[test]
fn bad_arguments_name_what_and_where() {
    let m = err_of(local_shape_and_offset(&[4], &[2, 2], &[0, 0], &[Shard(0)]));
    assert!(m.contains("`placements` has 1 entries but `mesh_shape` has 2"), "{m}");
    let m = err_of(local_shape_and_offset(&[4], &[2, 2], &[0], &[Shard(0), Replicate]));
    assert!(m.contains("`coordinate` has 1 entries"), "{m}");
    let m = err_of(local_shape_and_offset(&[4], &[2, 3], &[1, 3], &[Shard(0), Replicate]));
    assert!(m.contains("`coordinate[1]` is 3 but mesh dim 1 has 3 ranks"), "{m}");
    let m = err_of(local_shape_and_offset(&[4, 4], &[2, 2], &[0, 0], &[Replicate, Shard(2)]));
    assert!(m.contains("`placements[1]` is Shard(dim=2) but the tensor has 2 dims"), "{m}");
    let m = err_of(copy_plan(&[4], &[2, 0], &[0, 0], &[Shard(0), Replicate]));
    assert!(m.contains("`mesh_shape[1]` is 0"), "{m}");
    let m = err_of(seed_copy_slices(&[4], &[2], &[0], &[ss(0, 0)]));
    assert!(m.contains("`placements[0]` is _StridedShard(dim=0, sf=0)") && m.contains("at least 1"), "{m}");
    let m = err_of(gather_plan(&[4], &[2, 2], &[Shard(0), Partial]));
    assert!(m.contains("`placements[1]` is Partial()") && m.contains("reduce it first"), "{m}");
    let m = err_of(copy_plan(&[u64::MAX, 2], &[1], &[0], &[Replicate]));
    assert!(m.contains("`global_shape`"), "{m}");

    let plan = copy_plan(&[4, 3], &[2], &[1], &[Shard(0)]).unwrap();
    let full = [0u8; 12];
    let m = err_of(plan.apply(&full[..11], &mut [0u8; 6]));
    assert!(m.contains("`full` holds 11 elements but the plan needs exactly 12"), "{m}");
    let m = err_of(plan.apply(&full, &mut [0u8; 7]));
    assert!(m.contains("`local` holds 7 elements"), "{m}");
    let m = err_of(plan.scatter_back(&[0u8; 5], &mut [0u8; 12]));
    assert!(m.contains("`local` holds 5"), "{m}");
    let m = err_of(copy_runs_bytes(&plan, 0, &[], &mut []));
    assert!(m.contains("`elem_size` is 0"), "{m}");
    let m = err_of(copy_runs_bytes(&plan, 2, &[0u8; 24], &mut [0u8; 11]));
    assert!(m.contains("`local` holds 11 bytes but the plan needs exactly 12"), "{m}");
    let gp = gather_plan(&[4, 3], &[2], &[Shard(0)]).unwrap();
    let m = err_of(gp.gather(&[&[0u8; 6][..]], &mut [0u8; 12]));
    assert!(m.contains("`locals` has 1 tensors but the mesh [2] has 2 ranks"), "{m}");
    let m = err_of(gp.gather(&[&[0u8; 6][..], &[0u8; 5][..]], &mut [0u8; 12]));
    assert!(m.contains("`locals[1]` (coordinate [1])"), "{m}");
    // An empty mesh holds the whole tensor.
    assert_eq!(local_shape_and_offset(&[3, 2], &[], &[], &[]).unwrap(), (vec![3, 2], vec![0, 0]));
}

// --- C ABI ---------------------------------------------------------------------------------

fn cp(kind: i32, dim: i64, split_factor: i64) -> fsdpturbo_placement_t {
    fsdpturbo_placement_t { kind, dim, split_factor }
}

const S0: fsdpturbo_placement_t =
    fsdpturbo_placement_t { kind: FSDPTURBO_PLACEMENT_SHARD, dim: 0, split_factor: 0 };
const R: fsdpturbo_placement_t =
    fsdpturbo_placement_t { kind: FSDPTURBO_PLACEMENT_REPLICATE, dim: 0, split_factor: 0 };

fn c_local(
    global: &[u64],
    mesh: &[u64],
    coord: &[u64],
    pls: &[fsdpturbo_placement_t],
) -> (i32, Vec<u64>, Vec<u64>) {
    let (mut shape, mut off) = (vec![7u64; global.len()], vec![7u64; global.len()]);
    let st = fsdpturbo_local_shape_and_offset(
        global.as_ptr(),
        global.len(),
        mesh.as_ptr(),
        coord.as_ptr(),
        mesh.len(),
        pls.as_ptr(),
        shape.as_mut_ptr(),
        off.as_mut_ptr(),
    );
    (st, shape, off)
}

/// The pointer arguments of fsdpturbo_local_shape_and_offset.
#[derive(Clone, Copy)]
struct LocalShapeArgs {
    global_shape: *const u64,
    mesh_shape: *const u64,
    coordinate: *const u64,
    placements: *const fsdpturbo_placement_t,
    local_shape: *mut u64,
    global_offset: *mut u64,
}

#[test]
fn c_abi_local_shape_and_offset() {
    let (st, shape, off) =
        c_local(&[10, 3], &[2, 2], &[1, 1], &[cp(FSDPTURBO_PLACEMENT_STRIDED_SHARD, 0, 2), S0]);
    assert_eq!((st, shape, off), (FSDPTURBO_OK as i32, vec![2, 3], vec![8, 0]));
    assert_eq!(last_error(), "");
    let (st, shape, off) = c_local(&[3], &[4], &[3], &[S0]);
    assert_eq!((st, shape, off), (FSDPTURBO_OK as i32, vec![0], vec![3]));
    let partial = cp(FSDPTURBO_PLACEMENT_PARTIAL, 0, 0);
    assert_eq!(c_local(&[3], &[4], &[3], &[partial]), (FSDPTURBO_OK as i32, vec![3], vec![0]));

    // Invalid kind integers, negative dims, split factors, unused fields.
    let (st, shape, _) = c_local(&[4], &[2], &[0], &[cp(7, 0, 0)]);
    assert_eq!((st, shape), (FSDPTURBO_ERR_INVALID_ARGUMENT as i32, vec![7]), "outputs untouched on failure");
    assert!(
        last_error().starts_with("`placements[0].kind` is 7; accepted: FSDPTURBO_PLACEMENT_SHARD (0)"),
        "{}",
        last_error()
    );
    assert_eq!(c_local(&[4], &[2], &[0], &[cp(-1, 0, 0)]).0, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert_eq!(
        c_local(&[4], &[2, 2], &[0, 0], &[R, cp(FSDPTURBO_PLACEMENT_SHARD, -1, 0)]).0,
        FSDPTURBO_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("`placements[1].dim` is -1; tensor dims must be >= 0"), "{}", last_error());
    assert_eq!(
        c_local(&[4], &[2], &[0], &[cp(FSDPTURBO_PLACEMENT_STRIDED_SHARD, -2, 2)]).0,
        FSDPTURBO_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("`placements[0].dim` is -2"), "{}", last_error());
    assert_eq!(
        c_local(&[4], &[2], &[0], &[cp(FSDPTURBO_PLACEMENT_STRIDED_SHARD, 0, 0)]).0,
        FSDPTURBO_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("`placements[0].split_factor` is 0"), "{}", last_error());
    assert_eq!(
        c_local(&[4], &[2], &[0], &[cp(FSDPTURBO_PLACEMENT_SHARD, 0, 2)]).0,
        FSDPTURBO_ERR_INVALID_ARGUMENT
    );
    assert!(
        last_error()
            .contains("`placements[0].split_factor` is 2 but kind FSDPTURBO_PLACEMENT_SHARD does not use it")
    );
    assert_eq!(
        c_local(&[4], &[2], &[0], &[cp(FSDPTURBO_PLACEMENT_REPLICATE, 1, 0)]).0,
        FSDPTURBO_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("`placements[0].dim` is 1 but kind FSDPTURBO_PLACEMENT_REPLICATE"));
    // Core errors come through with their text.
    assert_eq!(c_local(&[4], &[2], &[2], &[S0]).0, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("`coordinate[0]` is 2 but mesh dim 0 has 2 ranks"));
    assert_eq!(
        c_local(&[4], &[2], &[0], &[cp(FSDPTURBO_PLACEMENT_SHARD, 1, 0)]).0,
        FSDPTURBO_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("`placements[0]` is Shard(dim=1) but the tensor has 1 dims"));

    // NULL pointers, one argument at a time.
    let (g, m, c, p) = ([4u64], [2u64], [0u64], [S0]);
    let (mut out, mut off) = ([0u64; 1], [0u64; 1]);
    let valid = LocalShapeArgs {
        global_shape: g.as_ptr(),
        mesh_shape: m.as_ptr(),
        coordinate: c.as_ptr(),
        placements: p.as_ptr(),
        local_shape: out.as_mut_ptr(),
        global_offset: off.as_mut_ptr(),
    };
    let (null, null_mut) = (std::ptr::null(), std::ptr::null_mut());
    let null_cases = [
        (LocalShapeArgs { global_shape: null, ..valid }, "argument `global_shape` must not be NULL"),
        (LocalShapeArgs { mesh_shape: null, ..valid }, "argument `mesh_shape` must not be NULL"),
        (LocalShapeArgs { coordinate: null, ..valid }, "argument `coordinate` must not be NULL"),
        (LocalShapeArgs { placements: std::ptr::null(), ..valid }, "argument `placements` must not be NULL"),
        (
            LocalShapeArgs { local_shape: null_mut, ..valid },
            "argument `local_shape` is NULL but must hold 1 elements",
        ),
        (
            LocalShapeArgs { global_offset: null_mut, ..valid },
            "argument `global_offset` is NULL but must hold 1 elements",
        ),
    ];
    for (args, message) in null_cases {
        let st = fsdpturbo_local_shape_and_offset(
            args.global_shape,
            1,
            args.mesh_shape,
            args.coordinate,
            1,
            args.placements,
            args.local_shape,
            args.global_offset,
        );
        assert_eq!((st, last_error().as_str()), (FSDPTURBO_ERR_NULL_ARGUMENT as i32, message));
    }
    // Zero lengths accept NULL: a scalar on an empty mesh.
    let st = fsdpturbo_local_shape_and_offset(
        null,
        0,
        null,
        null,
        0,
        std::ptr::null(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    assert_eq!(st, FSDPTURBO_OK);
}

fn c_plan(
    global: &[u64],
    mesh: &[u64],
    coord: &[u64],
    pls: &[fsdpturbo_placement_t],
) -> (i32, *mut fsdpturbo_copy_plan_t) {
    let mut plan = std::ptr::null_mut();
    let st = fsdpturbo_copy_plan_new(
        global.as_ptr(),
        global.len(),
        mesh.as_ptr(),
        coord.as_ptr(),
        mesh.len(),
        pls.as_ptr(),
        &mut plan,
    );
    (st, plan)
}

#[test]
fn c_abi_copy_plan_and_bytes() {
    // [6, 4] rows 2..4 of 3 ranks... with a strided level: [_StridedShard(0, 2)] over 2, rank 1.
    let global = [6u64, 4];
    let pls = [cp(FSDPTURBO_PLACEMENT_STRIDED_SHARD, 0, 2)];
    let (st, plan) = c_plan(&global, &[2], &[1], &pls);
    assert_eq!(st, FSDPTURBO_OK);
    assert!(!plan.is_null());
    let rust = copy_plan(&global, &[2], &[1], &[ss(0, 2)]).unwrap();
    // rows: pieces 0-2 and 3-5; rank 1 keeps row 2 and row 5.
    assert_eq!(rust.runs, vec![Run { src: 8, dst: 0, len: 4 }, Run { src: 20, dst: 4, len: 4 }]);

    let mut n = 0usize;
    assert_eq!(
        fsdpturbo_copy_plan_runs(plan, std::ptr::null_mut(), 0, &mut n),
        FSDPTURBO_ERR_BUFFER_TOO_SMALL
    );
    assert_eq!(n, 2);
    assert_eq!(last_error(), "buffer `triples` holds 0 runs, 2 are needed");
    let mut triples = [9u64; 6];
    assert_eq!(
        fsdpturbo_copy_plan_runs(plan, triples.as_mut_ptr(), 1, &mut n),
        FSDPTURBO_ERR_BUFFER_TOO_SMALL
    );
    assert_eq!(triples, [9; 6], "a short buffer is left untouched");
    assert_eq!(fsdpturbo_copy_plan_runs(plan, triples.as_mut_ptr(), 2, &mut n), FSDPTURBO_OK);
    assert_eq!(triples, [8, 0, 4, 20, 4, 4]);
    assert_eq!(
        fsdpturbo_copy_plan_runs(plan, triples.as_mut_ptr(), 2, std::ptr::null_mut()),
        FSDPTURBO_ERR_NULL_ARGUMENT
    );
    assert_eq!(last_error(), "argument `out_runs` must not be NULL");

    let mut shape = [0u64; 2];
    assert_eq!(
        fsdpturbo_copy_plan_local_shape(plan, shape.as_mut_ptr(), 1, &mut n),
        FSDPTURBO_ERR_BUFFER_TOO_SMALL
    );
    assert_eq!(n, 2);
    assert_eq!(fsdpturbo_copy_plan_local_shape(plan, shape.as_mut_ptr(), 2, &mut n), FSDPTURBO_OK);
    assert_eq!(shape, [2, 4]);
    let mut numel = 0u64;
    assert_eq!(fsdpturbo_copy_plan_local_numel(plan, &mut numel), FSDPTURBO_OK);
    assert_eq!(numel, 8);
    assert_eq!(fsdpturbo_copy_plan_local_numel(std::ptr::null(), &mut numel), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `plan` must not be NULL");

    // Bytes: bf16-sized elements.
    let full: Vec<u16> = (0..24).collect();
    let mut local = vec![0u16; 8];
    let (fp, lp) = (full.as_ptr().cast::<c_void>(), local.as_mut_ptr().cast::<c_void>());
    assert_eq!(fsdpturbo_copy_bytes(plan, 2, fp, 48, lp, 16), FSDPTURBO_OK);
    assert_eq!(local, [8, 9, 10, 11, 20, 21, 22, 23]);
    let mut back = vec![0xFFFFu16; 24];
    assert_eq!(
        fsdpturbo_copy_bytes_back(plan, 2, local.as_ptr().cast(), 16, back.as_mut_ptr().cast(), 48),
        FSDPTURBO_OK
    );
    let want: Vec<u16> =
        (0..24).map(|i| if (8..12).contains(&i) || (20..24).contains(&i) { i } else { 0xFFFF }).collect();
    assert_eq!(back, want);
    // Length mismatches, elem_size 0, NULL buffers, overlap.
    assert_eq!(fsdpturbo_copy_bytes(plan, 2, fp, 47, lp, 16), FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert_eq!(last_error(), "`full_bytes` is 47 but the full tensor [6, 4] of 2-byte elements is 48 bytes");
    assert_eq!(fsdpturbo_copy_bytes(plan, 2, fp, 48, lp, 32), FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert_eq!(
        last_error(),
        "`local_bytes` is 32 but the local tensor [2, 4] of 2-byte elements is 16 bytes"
    );
    assert_eq!(fsdpturbo_copy_bytes(plan, 4, fp, 48, lp, 16), FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(
        last_error()
            .starts_with("`full_bytes` is 48 but the full tensor [6, 4] of 4-byte elements is 96 bytes")
    );
    assert_eq!(fsdpturbo_copy_bytes(plan, 0, fp, 0, lp, 0), FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(last_error().starts_with("`elem_size` is 0"));
    assert_eq!(fsdpturbo_copy_bytes(plan, 2, std::ptr::null(), 48, lp, 16), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `full` is NULL but must hold 48 elements");
    assert_eq!(fsdpturbo_copy_bytes(plan, 2, fp, 48, std::ptr::null_mut(), 16), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `local` is NULL but must hold 16 elements");
    assert_eq!(fsdpturbo_copy_bytes(std::ptr::null(), 2, fp, 48, lp, 16), FSDPTURBO_ERR_NULL_ARGUMENT);
    let mut both = vec![0u16; 24];
    let bp = both.as_mut_ptr();
    let inner = unsafe { bp.add(4) }.cast::<c_void>();
    assert_eq!(
        fsdpturbo_copy_bytes(plan, 2, bp.cast_const().cast(), 48, inner, 16),
        FSDPTURBO_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        last_error(),
        "buffers `local` and `full` overlap; outputs must not share memory with other arguments"
    );
    assert_eq!(local, [8, 9, 10, 11, 20, 21, 22, 23], "untouched by failed calls");
    fsdpturbo_copy_plan_free(plan);
    fsdpturbo_copy_plan_free(std::ptr::null_mut());

    // An empty shard: no runs, zero-byte local buffer may be NULL.
    let (st, plan) = c_plan(&[3], &[4], &[3], &[S0]);
    assert_eq!(st, FSDPTURBO_OK);
    assert_eq!(fsdpturbo_copy_plan_runs(plan, std::ptr::null_mut(), 0, &mut n), FSDPTURBO_OK);
    assert_eq!(n, 0);
    let f3 = [1u8, 2, 3];
    assert_eq!(fsdpturbo_copy_bytes(plan, 1, f3.as_ptr().cast(), 3, std::ptr::null_mut(), 0), FSDPTURBO_OK);
    fsdpturbo_copy_plan_free(plan);

    // Plan creation errors: Partial, NULL out, bad kinds.
    let (st, plan) = c_plan(&[4], &[2], &[0], &[cp(FSDPTURBO_PLACEMENT_PARTIAL, 0, 0)]);
    assert_eq!((st, plan.is_null()), (FSDPTURBO_ERR_INVALID_ARGUMENT as i32, true));
    assert!(last_error().contains("`placements[0]` is Partial()"));
    let (st, _) = c_plan(&[4], &[2], &[0], &[cp(4, 0, 0)]);
    assert_eq!(st, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("`placements[0].kind` is 4"));
    let (g, m, c, p) = ([4u64], [2u64], [0u64], [S0]);
    let st =
        fsdpturbo_copy_plan_new(g.as_ptr(), 1, m.as_ptr(), c.as_ptr(), 1, p.as_ptr(), std::ptr::null_mut());
    assert_eq!(
        (st, last_error().as_str()),
        (FSDPTURBO_ERR_NULL_ARGUMENT as i32, "argument `out` must not be NULL")
    );
}

#[test]
fn c_abi_plans_equal_rust_plans_over_random_cases() {
    let mut rng = Rng(7);
    for _ in 0..300 {
        let (global, mesh, pls) = random_case(&mut rng);
        let coord: Vec<u64> = mesh.iter().map(|&m| rng.below_u64(m)).collect();
        let cpls: Vec<fsdpturbo_placement_t> = pls
            .iter()
            .map(|p| match *p {
                Shard(d) => cp(FSDPTURBO_PLACEMENT_SHARD, d as i64, 0),
                Placement::StridedShard { dim, split_factor } => {
                    cp(FSDPTURBO_PLACEMENT_STRIDED_SHARD, dim as i64, split_factor as i64)
                }
                Replicate => R,
                Partial => cp(FSDPTURBO_PLACEMENT_PARTIAL, 0, 0),
            })
            .collect();
        let rust = copy_plan(&global, &mesh, &coord, &pls).unwrap();
        let (st, plan) = c_plan(&global, &mesh, &coord, &cpls);
        assert_eq!(st, FSDPTURBO_OK);
        let mut n = 0usize;
        let mut triples = vec![0u64; 3 * rust.runs.len()];
        assert_eq!(
            fsdpturbo_copy_plan_runs(plan, triples.as_mut_ptr(), rust.runs.len(), &mut n),
            FSDPTURBO_OK
        );
        let want: Vec<u64> = rust.runs.iter().flat_map(|r| [r.src, r.dst, r.len]).collect();
        assert_eq!(triples, want);
        let (st, shape, off) = c_local(&global, &mesh, &coord, &cpls);
        assert_eq!(st, FSDPTURBO_OK);
        assert_eq!((shape, off), local_shape_and_offset(&global, &mesh, &coord, &pls).unwrap());
        fsdpturbo_copy_plan_free(plan);
    }
}
