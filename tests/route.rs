//! Token routing and the host MoE kernels (src/route.rs, src/ffi/route.rs): the seed's worked
//! example number for number, the edge cases (experts == ep, duplicate top-k ids, zero tokens,
//! ranks that send nothing, zero-token experts), seeded property tests against a naive argsort +
//! bincount reference, a simulated EP group that dispatches, computes and combines across ranks, the kernels against naive loops for every element type, thread-count
//! independence, and the C ABI.

use std::ffi::c_void;

use fsdpturbo::dtype::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use fsdpturbo::error::ErrorKind;
use fsdpturbo::ffi::dtype::{
    FSDPTURBO_DTYPE_BF16, FSDPTURBO_DTYPE_F16, FSDPTURBO_DTYPE_F32, FSDPTURBO_DTYPE_F64,
};
use fsdpturbo::ffi::gemm::*;
use fsdpturbo::ffi::route::*;
use fsdpturbo::ffi::status::*;
use fsdpturbo::host::gemm::*;
use fsdpturbo::host::{HostBuf, HostBufMut, KernelOptions, PARALLEL_MIN_ELEMS};
use fsdpturbo::route::*;

mod common;
use common::{Rng, last_error};

// ---------------------------------------------------------------------------------------------
// Helpers.

fn err_text(r: fsdpturbo::error::Result<impl std::fmt::Debug>) -> String {
    let e = r.expect_err("expected an error");
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{}", e.message);
    e.message
}

/// The naive reference: `argsort(f, stable=True)` by a stable comparison sort, `bincount`,
/// and the splits by their definition.
fn naive_route(ids: &[i64], e: usize, p: usize) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
    let mut perm: Vec<u64> = (0..ids.len() as u64).collect();
    perm.sort_by_key(|&j| ids[j as usize]);
    let mut cnt = vec![0u64; e];
    for &id in ids {
        cnt[id as usize] += 1;
    }
    let l = e / p;
    let splits = (0..p).map(|s| cnt[s * l..(s + 1) * l].iter().sum()).collect();
    (cnt, perm, splits)
}

/// What rank r of P receives, from the gathered counts `g [P, E]` (what the dispatch pipeline's
/// `Receive` computes, done naively here: Gl, its sums, `repeat_interleave`, a stable argsort).
struct Received {
    tokens_per_local_expert: Vec<u64>,
    output_splits: Vec<u64>,
    /// The local expert of each received row, in receive order (source-major).
    local_expert_of_row: Vec<u64>,
    /// The receive-order row at each local-expert-major position.
    chunk_order: Vec<u64>,
}

fn received(g: &[u64], p: usize, e: usize, r: usize) -> Received {
    let l = e / p;
    let gl = |s: usize, i: usize| g[s * e + r * l + i];
    let mut rows = Vec::new();
    for s in 0..p {
        for i in 0..l {
            rows.extend(std::iter::repeat_n(i as u64, gl(s, i) as usize));
        }
    }
    let mut order: Vec<u64> = (0..rows.len() as u64).collect();
    order.sort_by_key(|&j| rows[j as usize]);
    Received {
        tokens_per_local_expert: (0..l).map(|i| (0..p).map(|s| gl(s, i)).sum()).collect(),
        output_splits: (0..p).map(|s| (0..l).map(|i| gl(s, i)).sum()).collect(),
        local_expert_of_row: rows,
        chunk_order: order,
    }
}

// ---------------------------------------------------------------------------------------------
// Routing: the seed's worked example and the edge cases.

/// The seed's worked example: P=2, E=4, L=2, K=2.
#[test]
fn the_seeds_worked_example_number_for_number() {
    let rank0 = route(&[1, 2, 0, 3, 2, 1], 3, 2, 4, 2).unwrap();
    let rank1 = route(&[3, 0, 2, 3], 2, 2, 4, 2).unwrap();
    assert_eq!(rank0.tokens_per_expert, [1, 2, 2, 1]);
    assert_eq!(rank1.tokens_per_expert, [1, 0, 1, 2]);
    assert_eq!(rank0.input_splits, [3, 3]);
    assert_eq!(rank1.input_splits, [1, 3]);
    assert_eq!(rank0.permutation, [2, 0, 5, 1, 4, 3]);
    assert_eq!(rank0.token_of_row(), [1, 0, 2, 0, 2, 1]);
    assert_eq!(rank0.num_local_experts(), 2);
    assert_eq!(rank0.inverse_permutation(), [1, 3, 0, 5, 4, 2]);

    // The permuted rows of rank 0 are tokens [1, 0, 2, 0, 2, 1].
    let x: Vec<f32> = vec![10.0, 11.0, 20.0, 21.0, 30.0, 31.0];
    let mut permuted = vec![0f32; 12];
    permute_tokens(&x, 2, &rank0.permutation, 2, &mut permuted).unwrap();
    assert_eq!(permuted, [20.0, 21.0, 10.0, 11.0, 30.0, 31.0, 10.0, 11.0, 30.0, 31.0, 20.0, 21.0]);
}

#[test]
fn experts_equal_to_ep_size_give_one_local_expert() {
    // E = P = 4: the seed never sets expert_ids_per_ep_rank and crashes.
    let ids = [3, 1, 0, 3, 2, 3];
    let r = route(&ids, 3, 2, 4, 4).unwrap();
    assert_eq!(r.num_local_experts(), 1);
    assert_eq!(r.tokens_per_expert, [1, 1, 1, 3]);
    assert_eq!(r.input_splits, [1, 1, 1, 3]);
    assert_eq!(r.permutation, [2, 1, 4, 0, 3, 5]);
}

#[test]
fn duplicate_ids_within_a_tokens_top_k_keep_both_slots() {
    let r = route(&[2, 2, 0, 2], 2, 2, 4, 2).unwrap();
    assert_eq!(r.tokens_per_expert, [1, 0, 3, 0]);
    assert_eq!(r.permutation, [2, 0, 1, 3]);
    assert_eq!(r.input_splits, [1, 3]);
    // The combine adds both slots of token 0.
    let y = [1.0f64, 2.0, 4.0, 8.0]; // permuted rows, hidden 1
    let probs = [0.5f64, 0.25, 1.0, 2.0];
    let mut out = [0f64; 2];
    unpermute(HostBuf::F64(&y), 1, &r.permutation, 2, Some(HostBuf::F64(&probs)), HostBufMut::F64(&mut out))
        .unwrap();
    // token 0: slots 0, 1 at rows 1, 2; token 1: slot 2 at row 0, slot 3 at row 3.
    assert_eq!(out, [0.5 * 2.0 + 0.25 * 4.0, 1.0 * 1.0 + 2.0 * 8.0]);
}

#[test]
fn zero_tokens_route_permute_and_multiply_nothing() {
    let r = route(&[], 0, 8, 16, 4).unwrap();
    assert_eq!(r.tokens_per_expert, vec![0; 16]);
    assert!(r.permutation.is_empty());
    assert_eq!(r.input_splits, [0; 4]);
    let mut out: [f32; 0] = [];
    permute_tokens::<f32>(&[], 3, &[], 8, &mut out).unwrap();
    unpermute(HostBuf::F32(&[]), 3, &[], 8, None, HostBufMut::F32(&mut [])).unwrap();
    grouped_mm(HostBuf::F32(&[]), &[0, 0], HostBuf::F32(&[0.0; 12]), 3, 2, HostBufMut::F32(&mut [])).unwrap();
}

#[test]
fn ranks_that_send_nothing_and_zero_token_experts() {
    // P = 3, E = 6: rank 0 routes only to rank 0's experts, rank 1 only to rank 2's, rank 2
    // has no tokens; nobody routes to rank 1, and experts 1, 2, 3, 5 get nothing.
    let (e, p) = (6, 3);
    let r0 = route(&[0, 0, 0, 0], 2, 2, e, p).unwrap();
    let r1 = route(&[4, 4, 4, 4], 2, 2, e, p).unwrap();
    let r2 = route(&[], 0, 2, e, p).unwrap();
    assert_eq!(r0.input_splits, [4, 0, 0]);
    assert_eq!(r1.input_splits, [0, 0, 4]);
    assert_eq!(r2.input_splits, [0, 0, 0]);
    assert_eq!(r0.tokens_per_expert, [4, 0, 0, 0, 0, 0]);
}

#[test]
fn bad_routing_arguments_are_rejected_with_what_and_where() {
    // Out of range: the seed's histc re-bins E into E - 1 and drops the rest; we reject.
    let m = err_text(route(&[0, 1, 2, 4], 2, 2, 4, 2));
    assert!(m.contains("expert id 4 at token 1, k 1 (flat index 3)") && m.contains("[0, 4)"), "{m}");
    let m = err_text(route(&[0, -1, 2, 3], 2, 2, 4, 2));
    assert!(m.contains("expert id -1 at token 0, k 1"), "{m}");
    let m = err_text(route(&[i64::MIN, 0], 1, 2, 4, 2));
    assert!(m.contains(&format!("expert id {} at token 0, k 0", i64::MIN)), "{m}");
    // The first bad id is the one named.
    let m = err_text(route(&[0, 9, 7, 0], 2, 2, 4, 2));
    assert!(m.contains("expert id 9"), "{m}");
    // The seed's text for indivisible experts, exactly.
    assert_eq!(err_text(route(&[0], 1, 1, 6, 4)), "Number of experts(6) is not divisible by ep size(4).");
    assert!(err_text(route(&[], 0, 0, 4, 2)).contains("top_k must be >= 1"));
    assert!(err_text(route(&[], 0, 1, 0, 2)).contains("num_experts must be >= 1"));
    assert!(err_text(route(&[], 0, 1, 4, 0)).contains("ep_size must be >= 1"));
    let m = err_text(route(&[0, 1, 2], 2, 2, 4, 2));
    assert!(m.contains("`expert_ids` has 3 elements but must have 4"), "{m}");
    let m = err_text(route(&[], usize::MAX / 2, 4, 4, 2));
    assert!(m.contains("overflows"), "{m}");
    // route_into writes nothing on error.
    let (mut cnt, mut perm, mut splits) = ([7u64; 4], [7u64; 4], [7u64; 2]);
    assert!(route_into(&[0, 1, 2, 5], 2, 2, 4, 2, &mut cnt, &mut perm, &mut splits).is_err());
    assert_eq!((cnt, perm, splits), ([7; 4], [7; 4], [7; 2]));
    let m = err_text(route_into(&[0, 1], 1, 2, 4, 2, &mut cnt, &mut perm, &mut splits));
    assert!(m.contains("`permutation` has 4 elements but must have 2"), "{m}");
}

// ---------------------------------------------------------------------------------------------
// Property tests against the naive reference.

fn random_ids(rng: &mut Rng, tokens: usize, k: usize, e: usize) -> Vec<i64> {
    // Skewed (some experts hot, some empty) and with duplicate ids within a token's top-k.
    (0..tokens * k)
        .map(|_| if rng.below(3) == 0 { rng.below(e.div_ceil(3)) } else { rng.below(e) } as i64)
        .collect()
}

#[test]
fn routing_matches_argsort_and_bincount_on_random_inputs() {
    let mut rng = Rng(0x5eed);
    for case in 0..400 {
        let p = 1 + rng.below(5);
        let l = 1 + rng.below(4);
        let e = p * l;
        let k = 1 + rng.below(4);
        let t = if case % 10 == 0 { 0 } else { rng.below(40) };
        let ids = random_ids(&mut rng, t, k, e);
        let r = route(&ids, t, k, e, p).unwrap();
        let (cnt, perm, splits) = naive_route(&ids, e, p);
        assert_eq!(r.tokens_per_expert, cnt, "case {case}");
        assert_eq!(r.permutation, perm, "case {case}");
        assert_eq!(r.input_splits, splits, "case {case}");
        assert_eq!(invert_permutation(&r.permutation).unwrap(), r.inverse_permutation());
    }
}

/// One simulated EP group: every rank routes, permutes, "all-to-alls" its rows to the expert
/// owners, which sort them by local expert, apply their expert (row · (global id + 1)), undo the
/// sort, send the rows back, and each rank combines with its probabilities. The result must be
/// `Σ_k w[t, k] · (id[t, k] + 1) · x[t]`, computed in the same order: bit for bit.
fn simulate_ep(rng: &mut Rng, tokens: &[usize], k: usize, e: usize, ids: Option<Vec<Vec<i64>>>) {
    let p = tokens.len();
    let l = e / p;
    let h = 3;
    let ids: Vec<Vec<i64>> =
        ids.unwrap_or_else(|| tokens.iter().map(|&t| random_ids(rng, t, k, e)).collect());
    let xs: Vec<Vec<f64>> = tokens.iter().map(|&t| (0..t * h).map(|_| rng.unit()).collect()).collect();
    let ws: Vec<Vec<f64>> = tokens.iter().map(|&t| (0..t * k).map(|_| rng.unit()).collect()).collect();
    let routes: Vec<Routing> = (0..p).map(|r| route(&ids[r], tokens[r], k, e, p).unwrap()).collect();
    let g: Vec<u64> = routes.iter().flat_map(|r| r.tokens_per_expert.iter().copied()).collect();

    // Dispatch: permute, then the all-to-all by input_splits.
    let mut sent: Vec<Vec<Vec<f64>>> = Vec::new(); // [source][dest] rows
    for r in 0..p {
        let mut permuted = vec![0.0; tokens[r] * k * h];
        permute_tokens(&xs[r], h, &routes[r].permutation, k, &mut permuted).unwrap();
        let mut chunks = Vec::new();
        let mut at = 0;
        for d in 0..p {
            let n = routes[r].input_splits[d] as usize * h;
            chunks.push(permuted[at..at + n].to_vec());
            at += n;
        }
        sent.push(chunks);
    }
    let mut back: Vec<Vec<Vec<f64>>> = vec![Vec::new(); p]; // [dest][source] rows returned
    for d in 0..p {
        let rx = received(&g, p, e, d);
        let rows_in: Vec<f64> = (0..p).flat_map(|s| sent[s][d].iter().copied()).collect();
        let rows = rows_in.len() / h;
        assert_eq!(rows as u64, rx.output_splits.iter().sum::<u64>());
        let mut sorted = vec![0.0; rows * h];
        permute(&rows_in, h, &rx.chunk_order, &mut sorted).unwrap();
        // The expert: rows of local expert i are contiguous, tokens_per_local_expert[i] of them.
        let mut at = 0;
        for (i, &n) in rx.tokens_per_local_expert.iter().enumerate() {
            for row in at..at + n as usize {
                assert_eq!(rx.local_expert_of_row[rx.chunk_order[row] as usize], i as u64);
                let scale = (d * l + i + 1) as f64;
                sorted[row * h..(row + 1) * h].iter_mut().for_each(|v| *v *= scale);
            }
            at += n as usize;
        }
        // Undo the second sort (an unpermute with K = 1 and no weights), then send back.
        let mut unsorted = vec![0.0; rows * h];
        unpermute(HostBuf::F64(&sorted), h, &rx.chunk_order, 1, None, HostBufMut::F64(&mut unsorted))
            .unwrap();
        let mut at = 0;
        for s in 0..p {
            let n = rx.output_splits[s] as usize * h;
            back[d].push(unsorted[at..at + n].to_vec());
            at += n;
        }
    }
    for r in 0..p {
        let returned: Vec<f64> = (0..p).flat_map(|d| back[d][r].iter().copied()).collect();
        let mut out = vec![0.0; tokens[r] * h];
        let perm = &routes[r].permutation;
        unpermute(HostBuf::F64(&returned), h, perm, k, Some(HostBuf::F64(&ws[r])), HostBufMut::F64(&mut out))
            .unwrap();
        for t in 0..tokens[r] {
            for c in 0..h {
                let term =
                    |kk: usize| ws[r][t * k + kk] * ((ids[r][t * k + kk] + 1) as f64 * xs[r][t * h + c]);
                let mut want = term(0);
                for kk in 1..k {
                    want += term(kk);
                }
                assert_eq!(out[t * h + c].to_bits(), want.to_bits(), "rank {r}, token {t}, column {c}");
            }
        }
    }
}

#[test]
fn a_simulated_ep_group_dispatches_computes_and_combines_exactly() {
    let mut rng = Rng(3);
    // The seed's worked example, then experts == ep, a rank with no tokens, and random groups.
    simulate_ep(&mut rng, &[3, 2], 2, 4, Some(vec![vec![1, 2, 0, 3, 2, 1], vec![3, 0, 2, 3]]));
    simulate_ep(&mut rng, &[5, 4, 6, 1], 2, 4, None);
    simulate_ep(&mut rng, &[5, 0, 6], 3, 6, None);
    for _ in 0..60 {
        let p = 1 + rng.below(4);
        let e = p * (1 + rng.below(3));
        let tokens: Vec<usize> = (0..p).map(|_| rng.below(12)).collect();
        let k = 1 + rng.below(4);
        simulate_ep(&mut rng, &tokens, k, e, None);
    }
}

// ---------------------------------------------------------------------------------------------
// permute / unpermute.

#[test]
fn permute_gathers_rows_and_rejects_rows_outside_src() {
    let src: Vec<u16> = (0..12).collect(); // 4 rows × 3
    let mut dst = vec![0u16; 9];
    permute(&src, 3, &[3, 0, 3], &mut dst).unwrap();
    assert_eq!(dst, [9, 10, 11, 0, 1, 2, 9, 10, 11]);
    let mut dst = vec![77u16; 6];
    let m = err_text(permute(&src, 3, &[1, 4], &mut dst));
    assert!(m.contains("rows[1] = 4 is outside the 4 rows of `src`"), "{m}");
    assert_eq!(dst, [77; 6]);
    let m = err_text(permute_tokens(&src, 3, &[0, 8], 2, &mut dst));
    assert!(m.contains("permutation[1] = 8 (row 4 = 8 / 2) is outside the 4 rows"), "{m}");
    assert!(err_text(permute(&src, 0, &[], &mut [])).contains("hidden must be >= 1"));
    assert!(err_text(permute(&src, 5, &[], &mut [])).contains("not a whole number of rows"));
    assert!(err_text(permute(&src, 3, &[0], &mut dst)).contains("`dst` has 6 elements but must have 3"));
    assert!(err_text(permute_tokens(&src, 3, &[0], 0, &mut dst)).contains("top_k must be >= 1"));
}

/// The oracle of unpermute: the same operations in the same order, in the accumulator type.
fn unpermute_oracle(
    y: &[f64],
    h: usize,
    perm: &[u64],
    k: usize,
    w: Option<&[f64]>,
    round: impl Fn(f64) -> f64,
) -> Vec<f64> {
    let inv = invert_permutation(perm).unwrap();
    let t = perm.len() / k;
    let mut out = vec![0.0; t * h];
    for tok in 0..t {
        for c in 0..h {
            let term = |kk: usize| {
                let v = y[inv[tok * k + kk] as usize * h + c];
                match w {
                    Some(w) => round(w[tok * k + kk] * v),
                    None => v,
                }
            };
            let mut acc = term(0);
            for kk in 1..k {
                acc = round(acc + term(kk));
            }
            out[tok * h + c] = acc;
        }
    }
    out
}

#[test]
fn unpermute_matches_the_in_order_oracle_for_every_type() {
    let mut rng = Rng(9);
    for case in 0..60 {
        let (t, k, e, h) = (rng.below(20), 1 + rng.below(4), 1 + rng.below(8), 1 + rng.below(9));
        let r = route(&random_ids(&mut rng, t, k, e), t, k, e, 1).unwrap();
        let n = t * k;
        let y: Vec<f64> = (0..n * h).map(|_| rng.unit() * 4.0).collect();
        let w: Vec<f64> = (0..n).map(|_| rng.unit()).collect();
        let weights = if case % 3 == 0 { None } else { Some(&w[..]) };

        let mut o64 = vec![f64::NAN; t * h];
        let wb = weights.map(HostBuf::F64);
        unpermute(HostBuf::F64(&y), h, &r.permutation, k, wb, HostBufMut::F64(&mut o64)).unwrap();
        let want = unpermute_oracle(&y, h, &r.permutation, k, weights, |v| v);
        assert_eq!(
            o64.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );

        // f32: the oracle rounds every operation to f32.
        let y32: Vec<f32> = y.iter().map(|&v| v as f32).collect();
        let w32: Vec<f32> = w.iter().map(|&v| v as f32).collect();
        let mut o32 = vec![f32::NAN; t * h];
        let wb = weights.map(|_| HostBuf::F32(&w32));
        unpermute(HostBuf::F32(&y32), h, &r.permutation, k, wb, HostBufMut::F32(&mut o32)).unwrap();
        let y32d: Vec<f64> = y32.iter().map(|&v| v as f64).collect();
        let w32d: Vec<f64> = w32.iter().map(|&v| v as f64).collect();
        let want =
            unpermute_oracle(&y32d, h, &r.permutation, k, weights.map(|_| &w32d[..]), |v| v as f32 as f64);
        assert_eq!(o32, want.iter().map(|&v| v as f32).collect::<Vec<_>>(), "case {case}");

        // bf16 and f16: f32 accumulation, one rounding at the end.
        for (enc, dec, name) in [
            (f32_to_bf16 as fn(f32) -> u16, bf16_to_f32 as fn(u16) -> f32, "bf16"),
            (f32_to_f16, f16_to_f32, "f16"),
        ] {
            let y16: Vec<u16> = y.iter().map(|&v| enc(v as f32)).collect();
            let w16: Vec<u16> = w.iter().map(|&v| enc(v as f32)).collect();
            let mut o16 = vec![0xffffu16; t * h];
            let (yb, wb, ob) = if name == "bf16" {
                (HostBuf::Bf16(&y16), weights.map(|_| HostBuf::Bf16(&w16)), HostBufMut::Bf16(&mut o16))
            } else {
                (HostBuf::F16(&y16), weights.map(|_| HostBuf::F16(&w16)), HostBufMut::F16(&mut o16))
            };
            unpermute(yb, h, &r.permutation, k, wb, ob).unwrap();
            let yd: Vec<f64> = y16.iter().map(|&v| dec(v) as f64).collect();
            let wd: Vec<f64> = w16.iter().map(|&v| dec(v) as f64).collect();
            let want =
                unpermute_oracle(&yd, h, &r.permutation, k, weights.map(|_| &wd[..]), |v| v as f32 as f64);
            assert_eq!(o16, want.iter().map(|&v| enc(v as f32)).collect::<Vec<_>>(), "{name}, case {case}");
        }
    }
}

#[test]
fn unpermute_inverts_permute_exactly_with_k_1() {
    let mut rng = Rng(17);
    let (t, e, h) = (50, 7, 5);
    let r = route(&random_ids(&mut rng, t, 1, e), t, 1, e, 1).unwrap();
    // Special values survive: -0.0, inf, NaN payloads, subnormals.
    let mut x: Vec<f32> = (0..t * h).map(|_| rng.unit() as f32).collect();
    x[..5].copy_from_slice(&[-0.0, f32::INFINITY, f32::from_bits(0x7fc0_1234), 1e-45, f32::NEG_INFINITY]);
    let mut permuted = vec![0f32; t * h];
    permute_tokens(&x, h, &r.permutation, 1, &mut permuted).unwrap();
    let ones = vec![1f32; t];
    for probs in [None, Some(HostBuf::F32(&ones))] {
        let mut back = vec![0f32; t * h];
        unpermute(HostBuf::F32(&permuted), h, &r.permutation, 1, probs, HostBufMut::F32(&mut back)).unwrap();
        assert_eq!(
            back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            x.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
    // bf16 bit patterns, NaN included.
    let xb: Vec<u16> =
        (0..t * h).map(|i| if i == 3 { 0x7fc1 } else { f32_to_bf16(rng.unit() as f32) }).collect();
    let mut pb = vec![0u16; t * h];
    permute_tokens(&xb, h, &r.permutation, 1, &mut pb).unwrap();
    let mut back = vec![0u16; t * h];
    unpermute(HostBuf::Bf16(&pb), h, &r.permutation, 1, None, HostBufMut::Bf16(&mut back)).unwrap();
    assert_eq!(back, xb);
}

#[test]
fn unpermute_rejects_bad_permutations_lengths_and_mixed_types() {
    let y = [0f32; 8];
    let mut out = [0f32; 4];
    let m = err_text(unpermute(HostBuf::F32(&y), 2, &[0, 1, 1, 3], 2, None, HostBufMut::F32(&mut out)));
    assert!(m.contains("permutation[2] repeats the value 1 of permutation[1]"), "{m}");
    let m = err_text(unpermute(HostBuf::F32(&y), 2, &[0, 1, 4, 3], 2, None, HostBufMut::F32(&mut out)));
    assert!(m.contains("permutation[2] = 4 is outside [0, 4)"), "{m}");
    let m = err_text(unpermute(HostBuf::F32(&y), 2, &[0, 1, 2], 2, None, HostBufMut::F32(&mut out)));
    assert!(m.contains("not a multiple of top_k 2"), "{m}");
    let m = err_text(unpermute(HostBuf::F32(&y[..6]), 2, &[0, 1, 2, 3], 2, None, HostBufMut::F32(&mut out)));
    assert!(m.contains("`permuted` has 6 elements but must have 8"), "{m}");
    let m = err_text(unpermute(HostBuf::F32(&y), 2, &[0, 1, 2, 3], 2, None, HostBufMut::F32(&mut out[..3])));
    assert!(m.contains("`out` has 3 elements but must have 4"), "{m}");
    let m = err_text(unpermute(
        HostBuf::F32(&y),
        2,
        &[0, 1, 2, 3],
        2,
        Some(HostBuf::F32(&y[..3])),
        HostBufMut::F32(&mut out),
    ));
    assert!(m.contains("`probs` has 3 elements but must have 4"), "{m}");
    let p16 = [0u16; 4];
    let m = err_text(unpermute(
        HostBuf::F32(&y),
        2,
        &[0, 1, 2, 3],
        2,
        Some(HostBuf::Bf16(&p16)),
        HostBufMut::F32(&mut out),
    ));
    assert!(m.contains("`permuted` is f32 but `probs` is bf16"), "{m}");
    let mut o64 = [0f64; 4];
    let m = err_text(unpermute(HostBuf::F32(&y), 2, &[0, 1, 2, 3], 2, None, HostBufMut::F64(&mut o64)));
    assert!(m.contains("`permuted` is f32 but `out` is f64"), "{m}");
    assert!(
        err_text(unpermute(HostBuf::F32(&y), 2, &[0, 1, 2, 3], 0, None, HostBufMut::F32(&mut out)))
            .contains("top_k")
    );
    assert_eq!(out, [0.0; 4]);
}

#[test]
fn large_permute_and_unpermute_use_threads_and_stay_exact() {
    // Above PARALLEL_MIN_ELEMS elements, so the work is split over threads.
    let mut rng = Rng(23);
    let (t, k, e, h) = (1024, 4, 16, 300);
    assert!(t * k * h >= PARALLEL_MIN_ELEMS);
    let r = route(&random_ids(&mut rng, t, k, e), t, k, e, 1).unwrap();
    let x: Vec<u16> = (0..t * h).map(|_| f32_to_bf16(rng.unit() as f32)).collect();
    let w: Vec<u16> = (0..t * k).map(|_| f32_to_bf16(rng.unit() as f32)).collect();
    let mut permuted = vec![0u16; t * k * h];
    permute_tokens(&x, h, &r.permutation, k, &mut permuted).unwrap();
    for (i, row) in permuted.chunks(h).enumerate() {
        let tok = r.permutation[i] as usize / k;
        assert_eq!(row, &x[tok * h..(tok + 1) * h]);
    }
    let mut out = vec![0u16; t * h];
    unpermute(
        HostBuf::Bf16(&permuted),
        h,
        &r.permutation,
        k,
        Some(HostBuf::Bf16(&w)),
        HostBufMut::Bf16(&mut out),
    )
    .unwrap();
    // The portable loops and one thread give the same bits.
    for options in [PORTABLE, KernelOptions { threads: Some(1), portable: false }] {
        let mut other = vec![0u16; t * h];
        let (y, p) = (HostBuf::Bf16(&permuted), Some(HostBuf::Bf16(&w)));
        unpermute_with(y, h, &r.permutation, k, p, HostBufMut::Bf16(&mut other), options).unwrap();
        assert!(other == out, "{options:?}");
    }
    let yd: Vec<f64> = permuted.iter().map(|&v| bf16_to_f32(v) as f64).collect();
    let wd: Vec<f64> = w.iter().map(|&v| bf16_to_f32(v) as f64).collect();
    let want = unpermute_oracle(&yd, h, &r.permutation, k, Some(&wd), |v| v as f32 as f64);
    assert_eq!(out, want.iter().map(|&v| f32_to_bf16(v as f32)).collect::<Vec<_>>());
}

// ---------------------------------------------------------------------------------------------
// Grouped GEMM.

#[derive(Clone, Copy, Debug, PartialEq)]
enum Ty {
    F32,
    F64,
    Bf16,
    F16,
}

const TYPES: [Ty; 4] = [Ty::F32, Ty::F64, Ty::Bf16, Ty::F16];

/// A buffer of one element type, with its values as f64 (exactly what the kernel reads).
#[derive(Clone)]
enum Buf {
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bf16(Vec<u16>),
    F16(Vec<u16>),
}

impl Buf {
    fn from_f64(ty: Ty, v: &[f64]) -> Buf {
        match ty {
            Ty::F32 => Buf::F32(v.iter().map(|&x| x as f32).collect()),
            Ty::F64 => Buf::F64(v.to_vec()),
            Ty::Bf16 => Buf::Bf16(v.iter().map(|&x| f32_to_bf16(x as f32)).collect()),
            Ty::F16 => Buf::F16(v.iter().map(|&x| f32_to_f16(x as f32)).collect()),
        }
    }
    fn random(rng: &mut Rng, ty: Ty, n: usize) -> Buf {
        Buf::from_f64(ty, &(0..n).map(|_| rng.unit()).collect::<Vec<_>>())
    }
    /// A buffer of NaNs: every element must be overwritten.
    fn garbage(ty: Ty, n: usize) -> Buf {
        Buf::from_f64(ty, &vec![f64::NAN; n])
    }
    fn values(&self) -> Vec<f64> {
        match self {
            Buf::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Buf::F64(v) => v.clone(),
            Buf::Bf16(v) => v.iter().map(|&x| bf16_to_f32(x) as f64).collect(),
            Buf::F16(v) => v.iter().map(|&x| f16_to_f32(x) as f64).collect(),
        }
    }
    fn host(&self) -> HostBuf<'_> {
        match self {
            Buf::F32(v) => HostBuf::F32(v),
            Buf::F64(v) => HostBuf::F64(v),
            Buf::Bf16(v) => HostBuf::Bf16(v),
            Buf::F16(v) => HostBuf::F16(v),
        }
    }
    fn host_mut(&mut self) -> HostBufMut<'_> {
        match self {
            Buf::F32(v) => HostBufMut::F32(v),
            Buf::F64(v) => HostBufMut::F64(v),
            Buf::Bf16(v) => HostBufMut::Bf16(v),
            Buf::F16(v) => HostBufMut::F16(v),
        }
    }
    fn bits(&self) -> Vec<u64> {
        match self {
            Buf::F32(v) => v.iter().map(|x| x.to_bits() as u64).collect(),
            Buf::F64(v) => v.iter().map(|x| x.to_bits()).collect(),
            Buf::Bf16(v) | Buf::F16(v) => v.iter().map(|&x| x as u64).collect(),
        }
    }
}

/// Naive triple loops in f64: (value, Σ|terms|) of each output element.
struct Naive {
    value: Vec<f64>,
    bound: Vec<f64>,
}

/// Each of `len` output elements as its f64 sum and Σ|terms|, from the terms `terms(element)`
/// yields in order.
fn naive<I: Iterator<Item = f64>>(len: usize, terms: impl Fn(usize) -> I) -> Naive {
    let (value, bound) =
        (0..len).map(|at| terms(at).fold((0.0, 0.0), |(v, b), t| (v + t, b + t.abs()))).unzip();
    Naive { value, bound }
}

/// The group of each row, for groups of `counts[g]` consecutive rows.
fn group_of_row(counts: &[u64]) -> Vec<usize> {
    counts.iter().enumerate().flat_map(|(g, &m)| std::iter::repeat_n(g, m as usize)).collect()
}

fn naive_forward(x: &[f64], counts: &[u64], w: &[f64], i: usize, o: usize) -> Naive {
    let group = group_of_row(counts);
    naive(group.len() * o, |at| {
        let (r, j, g) = (at / o, at % o, group[at / o]);
        (0..i).map(move |p| x[r * i + p] * w[(g * o + j) * i + p])
    })
}

fn naive_grad_input(gy: &[f64], counts: &[u64], w: &[f64], i: usize, o: usize) -> Naive {
    let group = group_of_row(counts);
    naive(group.len() * i, |at| {
        let (r, c, g) = (at / i, at % i, group[at / i]);
        (0..o).map(move |j| gy[r * o + j] * w[(g * o + j) * i + c])
    })
}

fn naive_grad_weight(gy: &[f64], x: &[f64], counts: &[u64], i: usize, o: usize) -> Naive {
    let group = group_of_row(counts);
    naive(counts.len() * o * i, |at| {
        let (g, j, c) = (at / (o * i), at / i % o, at % i);
        let rows = group.partition_point(|&of| of < g)..group.partition_point(|&of| of <= g);
        rows.map(move |r| gy[r * o + j] * x[r * i + c])
    })
}

/// Checks `got` against the naive result: f64 to 1e-12 of Σ|terms|, f32 to 1e-5, and bf16/f16
/// to half an output ulp (2^-8 / 2^-11 relative) on top of the f32 accumulation error.
fn check(ty: Ty, got: &Buf, want: &Naive, what: &str) {
    let got = got.values();
    assert_eq!(got.len(), want.value.len(), "{what}");
    let (acc, out_rel) = match ty {
        Ty::F64 => (1e-12, 0.0),
        Ty::F32 => (1e-5, 0.0),
        Ty::Bf16 => (1e-5, 2f64.powi(-8)),
        Ty::F16 => (1e-5, 2f64.powi(-11)),
    };
    for (idx, ((&g, &v), &b)) in got.iter().zip(&want.value).zip(&want.bound).enumerate() {
        let tol = acc * b + out_rel * (v.abs() + acc * b) + if ty == Ty::F16 { 6e-8 } else { 0.0 };
        assert!(
            (g - v).abs() <= tol,
            "{what} {ty:?}: element {idx} is {g}, the naive loop gives {v} (tolerance {tol})"
        );
    }
}

fn gemm_case(rng: &mut Rng, ty: Ty, counts: &[u64], i: usize, o: usize, options: KernelOptions) {
    let n = counts.iter().sum::<u64>() as usize;
    let g = counts.len();
    let x = Buf::random(rng, ty, n * i);
    let w = Buf::random(rng, ty, g * o * i);
    let gy = Buf::random(rng, ty, n * o);
    let what = format!("counts {counts:?}, in {i}, out {o}");

    let mut y = Buf::garbage(ty, n * o);
    grouped_mm_with(x.host(), counts, w.host(), i, o, y.host_mut(), options).unwrap();
    check(ty, &y, &naive_forward(&x.values(), counts, &w.values(), i, o), &format!("forward, {what}"));

    let mut gx = Buf::garbage(ty, n * i);
    grouped_mm_grad_input_with(gy.host(), counts, w.host(), i, o, gx.host_mut(), options).unwrap();
    check(ty, &gx, &naive_grad_input(&gy.values(), counts, &w.values(), i, o), &format!("grad_x, {what}"));

    let mut gw = Buf::garbage(ty, g * o * i);
    grouped_mm_grad_weight_with(gy.host(), x.host(), counts, i, o, gw.host_mut(), options).unwrap();
    let want = naive_grad_weight(&gy.values(), &x.values(), counts, i, o);
    check(ty, &gw, &want, &format!("grad_w, {what}"));
    // Empty groups get exact zeros.
    let vals = gw.values();
    for (gi, &m) in counts.iter().enumerate() {
        if m == 0 {
            assert!(
                vals[gi * o * i..(gi + 1) * o * i].iter().all(|&v| v == 0.0),
                "grad_w of empty group {gi}"
            );
        }
    }
}

#[test]
fn grouped_mm_and_its_gradients_match_naive_loops_for_every_type() {
    let mut rng = Rng(31);
    // Edge tiles (sizes not multiples of 6 or 16/8), empty groups first, middle and last,
    // one-row groups, depths above the K block (256), and a single group.
    let shapes: [(&[u64], usize, usize); 8] = [
        (&[0, 3, 0, 7, 1, 0], 5, 9),
        (&[13], 17, 33),
        (&[1, 1, 1], 1, 1),
        (&[6, 16, 0], 16, 6),
        (&[40, 0, 25], 300, 20),
        (&[9, 2], 20, 270),
        (&[0, 0], 8, 8),
        (&[300, 5], 7, 3),
    ];
    for ty in TYPES {
        for &(counts, i, o) in &shapes {
            gemm_case(&mut rng, ty, counts, i, o, KernelOptions::default());
        }
    }
    // The default entry points are the defaults of the `_with` ones.
    let (x, w) = (Buf::random(&mut rng, Ty::F32, 10 * 7), Buf::random(&mut rng, Ty::F32, 2 * 5 * 7));
    let (mut a, mut b) = (Buf::garbage(Ty::F32, 50), Buf::garbage(Ty::F32, 50));
    grouped_mm(x.host(), &[4, 6], w.host(), 7, 5, a.host_mut()).unwrap();
    grouped_mm_with(x.host(), &[4, 6], w.host(), 7, 5, b.host_mut(), KernelOptions::default()).unwrap();
    assert!(a.bits() == b.bits());
}

const PORTABLE: KernelOptions = KernelOptions { threads: None, portable: true };

#[test]
fn the_portable_gemm_kernels_match_naive_loops_too() {
    // The loops used where the CPU lacks AVX2 + FMA, forced here.
    let mut rng = Rng(33);
    for ty in TYPES {
        gemm_case(&mut rng, ty, &[0, 3, 0, 7, 1, 0], 5, 9, PORTABLE);
        gemm_case(&mut rng, ty, &[40, 0, 25], 300, 20, PORTABLE);
        gemm_case(&mut rng, ty, &[9, 2], 20, 270, PORTABLE);
    }
    gemm_case(&mut rng, Ty::F32, &[1030, 0, 7], 270, 290, KernelOptions { threads: Some(2), portable: true });
}

#[test]
fn grouped_mm_blocks_large_problems_correctly() {
    // Rows above the per-task limit (1020), columns above the per-task width, depth above the
    // K block and above the B packing chunk: every blocking path, on several threads.
    let mut rng = Rng(37);
    // A depth above what one task packs of B at a time (4096 at 256 columns).
    for ty in [Ty::F32, Ty::Bf16] {
        gemm_case(&mut rng, ty, &[3, 0, 2], 4200, 256, KernelOptions::default());
    }
    for ty in [Ty::F32, Ty::F64, Ty::Bf16] {
        gemm_case(&mut rng, ty, &[1030, 0, 7], 270, 290, KernelOptions { threads: Some(3), portable: false });
    }
}

#[test]
fn grouped_mm_results_do_not_depend_on_the_thread_count_or_the_instruction_set() {
    let mut rng = Rng(41);
    let counts = [700u64, 0, 130, 1100, 5];
    let (i, o) = (260, 300);
    let n = counts.iter().sum::<u64>() as usize;
    for ty in [Ty::F32, Ty::F64, Ty::Bf16] {
        let x = Buf::random(&mut rng, ty, n * i);
        let w = Buf::random(&mut rng, ty, counts.len() * o * i);
        let gy = Buf::random(&mut rng, ty, n * o);
        let run = |threads: usize, portable: bool| {
            let options = KernelOptions { threads: Some(threads), portable };
            let mut y = Buf::garbage(ty, n * o);
            let mut gx = Buf::garbage(ty, n * i);
            let mut gw = Buf::garbage(ty, counts.len() * o * i);
            grouped_mm_with(x.host(), &counts, w.host(), i, o, y.host_mut(), options).unwrap();
            grouped_mm_grad_input_with(gy.host(), &counts, w.host(), i, o, gx.host_mut(), options).unwrap();
            grouped_mm_grad_weight_with(gy.host(), x.host(), &counts, i, o, gw.host_mut(), options).unwrap();
            (y.bits(), gx.bits(), gw.bits())
        };
        let one = run(1, false);
        for threads in [0, 2, 3, 8] {
            assert!(run(threads, false) == one, "{ty:?}: {threads} threads differ from 1");
        }
        let portable = run(1, true);
        assert!(run(3, true) == portable, "{ty:?}: portable kernels, 3 threads differ from 1");
        assert!(portable == one, "{ty:?}: the portable kernels differ from the process's instruction set");
        // The default (all cores above the threshold) agrees too.
        let mut y = Buf::garbage(ty, n * o);
        grouped_mm(x.host(), &counts, w.host(), i, o, y.host_mut()).unwrap();
        assert!(y.bits() == one.0);
    }
}

#[test]
fn grouped_mm_with_zero_features_writes_zeros() {
    let counts = [2u64, 0, 1];
    // in_features 0: y is all zeros; grad_w is empty; grad_x is empty.
    let mut y = Buf::garbage(Ty::F32, 3 * 4);
    grouped_mm(HostBuf::F32(&[]), &counts, HostBuf::F32(&[]), 0, 4, y.host_mut()).unwrap();
    assert_eq!(y.values(), vec![0.0; 12]);
    // out_features 0: grad_x is all zeros.
    let mut gx = Buf::garbage(Ty::Bf16, 3 * 5);
    grouped_mm_grad_input(HostBuf::Bf16(&[]), &counts, HostBuf::Bf16(&[]), 5, 0, gx.host_mut()).unwrap();
    assert_eq!(gx.values(), vec![0.0; 15]);
    // No rows at all: grad_w is all zeros.
    let mut gw = Buf::garbage(Ty::F64, 2 * 3 * 4);
    grouped_mm_grad_weight(HostBuf::F64(&[]), HostBuf::F64(&[]), &[0, 0], 4, 3, gw.host_mut()).unwrap();
    assert_eq!(gw.values(), vec![0.0; 24]);
}

#[test]
fn grouped_mm_rejects_bad_shapes_and_mixed_types() {
    let x = [0f32; 6];
    let w = [0f32; 12];
    let mut y = [0f32; 9];
    let ok = grouped_mm(HostBuf::F32(&x), &[1, 2], HostBuf::F32(&w), 2, 3, HostBufMut::F32(&mut y));
    assert!(ok.is_ok());
    let m = err_text(grouped_mm(HostBuf::F32(&x), &[1, 1], HostBuf::F32(&w), 2, 3, HostBufMut::F32(&mut y)));
    assert!(m.contains("`x` has 6 elements but must have 4 ([2 rows (Σ group_rows), in_features 2])"), "{m}");
    let m = err_text(grouped_mm(
        HostBuf::F32(&x),
        &[1, 2],
        HostBuf::F32(&w[..10]),
        2,
        3,
        HostBufMut::F32(&mut y),
    ));
    assert!(
        m.contains("`weight` has 10 elements but must have 12 ([groups 2, out_features 3, in_features 2])"),
        "{m}"
    );
    let m =
        err_text(grouped_mm(HostBuf::F32(&x), &[1, 2], HostBuf::F32(&w), 2, 3, HostBufMut::F32(&mut y[..5])));
    assert!(m.contains("`y` has 5 elements"), "{m}");
    let wb = [0u16; 12];
    let m =
        err_text(grouped_mm(HostBuf::F32(&x), &[1, 2], HostBuf::Bf16(&wb), 2, 3, HostBufMut::F32(&mut y)));
    assert!(m.contains("`x` is f32 but `weight` is bf16"), "{m}");
    let m = err_text(grouped_mm(
        HostBuf::F32(&x),
        &[u64::MAX, 2],
        HostBuf::F32(&w),
        2,
        3,
        HostBufMut::F32(&mut y),
    ));
    assert!(m.contains("overflow"), "{m}");
    let m = err_text(grouped_mm_grad_input(
        HostBuf::F32(&y),
        &[1, 2],
        HostBuf::F32(&w),
        2,
        3,
        HostBufMut::F32(&mut [0f32; 5]),
    ));
    assert!(m.contains("`grad_x` has 5 elements but must have 6"), "{m}");
    let m = err_text(grouped_mm_grad_weight(
        HostBuf::F32(&y),
        HostBuf::F32(&x),
        &[1, 2],
        2,
        3,
        HostBufMut::F32(&mut [0f32; 11]),
    ));
    assert!(m.contains("`grad_weight` has 11 elements but must have 12"), "{m}");
    let mut y64 = [0f64; 9];
    let m =
        err_text(grouped_mm(HostBuf::F32(&x), &[1, 2], HostBuf::F32(&w), 2, 3, HostBufMut::F64(&mut y64)));
    assert!(m.contains("`x` is f32 but `y` is f64"), "{m}");
}

// ---------------------------------------------------------------------------------------------
// The C ABI.

#[test]
fn c_abi_route_on_the_worked_example() {
    let ids: [i64; 6] = [1, 2, 0, 3, 2, 1];
    let (mut cnt, mut perm, mut splits) = ([0u64; 4], [0u64; 6], [0u64; 2]);
    let st =
        fsdpturbo_route(ids.as_ptr(), 3, 2, 4, 2, cnt.as_mut_ptr(), perm.as_mut_ptr(), splits.as_mut_ptr());
    assert_eq!(st, FSDPTURBO_OK, "{}", last_error());
    assert_eq!((cnt, perm, splits), ([1, 2, 2, 1], [2, 0, 5, 1, 4, 3], [3, 3]));
    // Zero tokens with NULL ids and permutation.
    let st = fsdpturbo_route(
        std::ptr::null(),
        0,
        2,
        4,
        2,
        cnt.as_mut_ptr(),
        std::ptr::null_mut(),
        splits.as_mut_ptr(),
    );
    assert_eq!(st, FSDPTURBO_OK, "{}", last_error());
    assert_eq!((cnt, splits), ([0; 4], [0; 2]));
}

#[test]
fn c_abi_routing_errors_name_the_problem_and_write_nothing() {
    let ids: [i64; 4] = [0, 1, 7, 3];
    let (mut cnt, mut perm, mut splits) = ([5u64; 4], [5u64; 4], [5u64; 2]);
    let st =
        fsdpturbo_route(ids.as_ptr(), 2, 2, 4, 2, cnt.as_mut_ptr(), perm.as_mut_ptr(), splits.as_mut_ptr());
    assert_eq!(st, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("expert id 7 at token 1, k 0"), "{}", last_error());
    assert_eq!((cnt, perm, splits), ([5; 4], [5; 4], [5; 2]));
    let st =
        fsdpturbo_route(ids.as_ptr(), 2, 2, 6, 4, cnt.as_mut_ptr(), perm.as_mut_ptr(), splits.as_mut_ptr());
    assert_eq!(st, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert_eq!(last_error(), "Number of experts(6) is not divisible by ep size(4).");
    let st = fsdpturbo_route(
        std::ptr::null(),
        2,
        2,
        4,
        2,
        cnt.as_mut_ptr(),
        perm.as_mut_ptr(),
        splits.as_mut_ptr(),
    );
    assert_eq!(st, FSDPTURBO_ERR_NULL_ARGUMENT);
    assert!(last_error().contains("`expert_ids` is NULL but must hold 4 elements"));
    let st =
        fsdpturbo_route(ids.as_ptr(), 2, 2, 4, 2, cnt.as_mut_ptr(), perm.as_mut_ptr(), std::ptr::null_mut());
    assert_eq!(st, FSDPTURBO_ERR_NULL_ARGUMENT);
    // Misaligned ids.
    let raw = [0u64; 5];
    let misaligned = unsafe { raw.as_ptr().cast::<u8>().add(4) }.cast::<i64>();
    let st =
        fsdpturbo_route(misaligned, 2, 2, 4, 2, cnt.as_mut_ptr(), perm.as_mut_ptr(), splits.as_mut_ptr());
    assert_eq!(st, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("not aligned"), "{}", last_error());
    // Overlapping outputs.
    let mut both = [0u64; 6];
    let st = fsdpturbo_route(
        ids.as_ptr(),
        2,
        2,
        4,
        2,
        both.as_mut_ptr(),
        both.as_mut_ptr().wrapping_add(2),
        splits.as_mut_ptr(),
    );
    assert_eq!(st, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("`tokens_per_expert` and `permutation` overlap"), "{}", last_error());
}

#[test]
fn c_abi_permute_and_unpermute() {
    let ids: [i64; 6] = [1, 2, 0, 3, 2, 1];
    let r = route(&ids, 3, 2, 4, 2).unwrap();
    let x: Vec<u16> = (0..6).map(|v| f32_to_bf16(v as f32 + 1.0)).collect(); // [3, 2]
    let mut permuted = vec![0u16; 12];
    let st = fsdpturbo_permute_rows(
        FSDPTURBO_DTYPE_BF16,
        x.as_ptr().cast(),
        12,
        2,
        r.permutation.as_ptr(),
        6,
        2,
        permuted.as_mut_ptr().cast(),
        24,
    );
    assert_eq!(st, FSDPTURBO_OK, "{}", last_error());
    let mut want = vec![0u16; 12];
    permute_tokens(&x, 2, &r.permutation, 2, &mut want).unwrap();
    assert_eq!(permuted, want);

    // Combine with probabilities, and without.
    let probs: Vec<u16> = [0.5f32, 0.25, 1.0, 2.0, 0.75, 1.5].iter().map(|&v| f32_to_bf16(v)).collect();
    for with_probs in [true, false] {
        let mut out = vec![0u16; 6];
        let (pp, pb): (*const c_void, usize) =
            if with_probs { (probs.as_ptr().cast(), 12) } else { (std::ptr::null(), 0) };
        let st = fsdpturbo_unpermute(
            FSDPTURBO_DTYPE_BF16,
            permuted.as_ptr().cast(),
            24,
            2,
            r.permutation.as_ptr(),
            3,
            2,
            pp,
            pb,
            out.as_mut_ptr().cast(),
            12,
        );
        assert_eq!(st, FSDPTURBO_OK, "{}", last_error());
        let mut core = vec![0u16; 6];
        let p = with_probs.then_some(HostBuf::Bf16(&probs));
        unpermute(HostBuf::Bf16(&permuted), 2, &r.permutation, 2, p, HostBufMut::Bf16(&mut core)).unwrap();
        assert_eq!(out, core);
        let w = |t: usize, k: usize| if with_probs { bf16_to_f32(probs[t * 2 + k]) } else { 1.0 };
        for t in 0..3 {
            for c in 0..2 {
                let v = bf16_to_f32(x[t * 2 + c]);
                assert_eq!(bf16_to_f32(out[t * 2 + c]), w(t, 0) * v + w(t, 1) * v);
            }
        }
    }

    // Errors.
    let mut dst = vec![7u16; 12];
    let p = |dtype: i32,
             src_bytes: usize,
             hidden: usize,
             rows: &[u64],
             div: usize,
             dst: &mut [u16],
             dst_bytes: usize| {
        fsdpturbo_permute_rows(
            dtype,
            x.as_ptr().cast(),
            src_bytes,
            hidden,
            rows.as_ptr(),
            rows.len(),
            div,
            dst.as_mut_ptr().cast(),
            dst_bytes,
        )
    };
    assert_eq!(p(7, 12, 2, &r.permutation, 2, &mut dst, 24), FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("`dtype` is 7"), "{}", last_error());
    assert_eq!(
        p(FSDPTURBO_DTYPE_BF16, 12, 0, &r.permutation, 2, &mut dst, 24),
        FSDPTURBO_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        p(FSDPTURBO_DTYPE_BF16, 12, 2, &r.permutation, 0, &mut dst, 24),
        FSDPTURBO_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        p(FSDPTURBO_DTYPE_BF16, 10, 2, &r.permutation, 2, &mut dst, 24),
        FSDPTURBO_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("`src_bytes` is 10, not a whole number of rows"), "{}", last_error());
    assert_eq!(
        p(FSDPTURBO_DTYPE_BF16, 12, 2, &r.permutation, 2, &mut dst, 22),
        FSDPTURBO_ERR_INVALID_ARGUMENT
    );
    assert!(
        last_error().contains("`dst_bytes` is 22 but [n_rows 6, hidden 2] of 2-byte elements is 24 bytes"),
        "{}",
        last_error()
    );
    assert_eq!(
        p(FSDPTURBO_DTYPE_BF16, 12, 2, &r.permutation, 1, &mut dst, 24),
        FSDPTURBO_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("rows[2] = 5 is outside the 3 rows"), "{}", last_error());
    assert_eq!(dst, [7; 12]);
    // In place is an overlap.
    let mut inplace = x.clone();
    let st = fsdpturbo_permute_rows(
        FSDPTURBO_DTYPE_BF16,
        inplace.as_ptr().cast(),
        12,
        2,
        [2u64, 1, 0].as_ptr(),
        3,
        1,
        inplace.as_mut_ptr().cast(),
        12,
    );
    assert_eq!(st, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("`dst` and `src` overlap"), "{}", last_error());

    // Unpermute errors: NULL probs with bytes, short probs, a repeated index, and bytes that do
    // not fit the element type.
    let mut out = vec![0u16; 6];
    let bad_perm = [0u64, 0, 1, 2, 3, 4];
    let (perm, null) = (r.permutation.as_ptr(), std::ptr::null());
    let unpermute_cases = [
        (FSDPTURBO_DTYPE_BF16, perm, null, 12, "`probs` is NULL but `probs_bytes` is 12"),
        (
            FSDPTURBO_DTYPE_BF16,
            perm,
            probs.as_ptr().cast(),
            10,
            "`probs_bytes` is 10 but [tokens 3, top_k 2]",
        ),
        (FSDPTURBO_DTYPE_BF16, bad_perm.as_ptr(), null, 0, "permutation[1] repeats the value 0"),
        (
            FSDPTURBO_DTYPE_F32,
            perm,
            null,
            0,
            "`permuted_bytes` is 24 but [tokens 3 × top_k 2, hidden 2] of 4-byte elements is 48 bytes",
        ),
    ];
    for (dtype, permutation, probs, probs_bytes, message) in unpermute_cases {
        let st = fsdpturbo_unpermute(
            dtype,
            permuted.as_ptr().cast(),
            24,
            2,
            permutation,
            3,
            2,
            probs,
            probs_bytes,
            out.as_mut_ptr().cast(),
            12,
        );
        assert_eq!(st, FSDPTURBO_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains(message), "{}", last_error());
    }
    assert_eq!(out, [0; 6]);
}

#[test]
fn c_abi_grouped_mm_and_gradients_match_the_core() {
    let mut rng = Rng(53);
    let counts = [3u64, 0, 4];
    let (i, o, n) = (5usize, 7usize, 7usize);
    for (ty, code, size) in [
        (Ty::F32, FSDPTURBO_DTYPE_F32, 4),
        (Ty::F64, FSDPTURBO_DTYPE_F64, 8),
        (Ty::Bf16, FSDPTURBO_DTYPE_BF16, 2),
        (Ty::F16, FSDPTURBO_DTYPE_F16, 2),
    ] {
        let x = Buf::random(&mut rng, ty, n * i);
        let w = Buf::random(&mut rng, ty, 3 * o * i);
        let gy = Buf::random(&mut rng, ty, n * o);
        let ptr = |b: &Buf| -> *const c_void {
            match b {
                Buf::F32(v) => v.as_ptr().cast(),
                Buf::F64(v) => v.as_ptr().cast(),
                Buf::Bf16(v) | Buf::F16(v) => v.as_ptr().cast(),
            }
        };
        let mptr = |b: &mut Buf| -> *mut c_void {
            match b {
                Buf::F32(v) => v.as_mut_ptr().cast(),
                Buf::F64(v) => v.as_mut_ptr().cast(),
                Buf::Bf16(v) | Buf::F16(v) => v.as_mut_ptr().cast(),
            }
        };
        let forward = |x_bytes: usize, y: &mut Buf, y_bytes: usize| {
            let w_bytes = 3 * o * i * size;
            fsdpturbo_grouped_mm(
                code,
                ptr(&x),
                x_bytes,
                counts.as_ptr(),
                3,
                i,
                o,
                ptr(&w),
                w_bytes,
                mptr(y),
                y_bytes,
            )
        };
        let (mut y, mut y_core) = (Buf::garbage(ty, n * o), Buf::garbage(ty, n * o));
        assert_eq!(forward(n * i * size, &mut y, n * o * size), FSDPTURBO_OK, "{}", last_error());
        grouped_mm(x.host(), &counts, w.host(), i, o, y_core.host_mut()).unwrap();
        assert!(y.bits() == y_core.bits(), "{ty:?}");

        let (mut gx, mut gx_core) = (Buf::garbage(ty, n * i), Buf::garbage(ty, n * i));
        let st = fsdpturbo_grouped_mm_grad_input(
            code,
            ptr(&gy),
            n * o * size,
            counts.as_ptr(),
            3,
            i,
            o,
            ptr(&w),
            3 * o * i * size,
            mptr(&mut gx),
            n * i * size,
        );
        assert_eq!(st, FSDPTURBO_OK, "{}", last_error());
        grouped_mm_grad_input(gy.host(), &counts, w.host(), i, o, gx_core.host_mut()).unwrap();
        assert!(gx.bits() == gx_core.bits(), "{ty:?}");

        let (mut gw, mut gw_core) = (Buf::garbage(ty, 3 * o * i), Buf::garbage(ty, 3 * o * i));
        let st = fsdpturbo_grouped_mm_grad_weight(
            code,
            ptr(&gy),
            n * o * size,
            ptr(&x),
            n * i * size,
            counts.as_ptr(),
            3,
            i,
            o,
            mptr(&mut gw),
            3 * o * i * size,
        );
        assert_eq!(st, FSDPTURBO_OK, "{}", last_error());
        grouped_mm_grad_weight(gy.host(), x.host(), &counts, i, o, gw_core.host_mut()).unwrap();
        assert!(gw.bits() == gw_core.bits(), "{ty:?}");
        check(ty, &gw, &naive_grad_weight(&gy.values(), &x.values(), &counts, i, o), "C grad_w");

        // Byte lengths that are not whole elements, or do not match the shapes.
        let bad_lengths: [(usize, usize, &[&str]); 2] = [
            (n * i * size - 1, n * o * size, &["`x_bytes`", "whole number"]),
            (n * i * size, (n * o - 1) * size, &["`y` has"]),
        ];
        for (x_bytes, y_bytes, wanted) in bad_lengths {
            assert_eq!(forward(x_bytes, &mut y, y_bytes), FSDPTURBO_ERR_INVALID_ARGUMENT);
            assert!(wanted.iter().all(|w| last_error().contains(w)), "{}", last_error());
        }
    }
    // A bad dtype code, an output that overlaps an input, a NULL group list: each a valid f32
    // call but for the arguments its case sets.
    let x = [0f32; 35];
    let w = [0f32; 105];
    let mut y = [0f32; 49];
    let mut both = [0f32; 105];
    let (y_ptr, both_ptr) = (y.as_mut_ptr(), both.as_mut_ptr());
    let cases = [
        (9, w.as_ptr(), counts.as_ptr(), y_ptr, FSDPTURBO_ERR_INVALID_ARGUMENT, "`dtype` is 9"),
        (
            FSDPTURBO_DTYPE_F32,
            both_ptr.cast_const(),
            counts.as_ptr(),
            both_ptr.wrapping_add(50),
            FSDPTURBO_ERR_INVALID_ARGUMENT,
            "`y` and `weight` overlap",
        ),
        (
            FSDPTURBO_DTYPE_F32,
            w.as_ptr(),
            std::ptr::null(),
            y_ptr,
            FSDPTURBO_ERR_NULL_ARGUMENT,
            "`group_rows`",
        ),
    ];
    for (dtype, weight, group_rows, y, status, message) in cases {
        let st = fsdpturbo_grouped_mm(
            dtype,
            x.as_ptr().cast(),
            140,
            group_rows,
            3,
            i,
            o,
            weight.cast(),
            420,
            y.cast(),
            196,
        );
        assert_eq!(st, status);
        assert!(last_error().contains(message), "{}", last_error());
    }
    assert_eq!(y, [0.0; 49]);
}
