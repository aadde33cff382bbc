//! The aclnn MoE token permute/unpermute and MC2 operators (src/backend/ascend/aclnn/{moe,mc2}.rs)
//! against the C test doubles: real results compared with host arithmetic, the call protocol,
//! the communicator found by its HCCL name, and the errors when an operator is missing.

mod doubles;

use std::ffi::CString;

use doubles::{Host, f32_view, live_objects, normalize, stream};
use fsdpturbo::backend::ascend::acl::{ACL_BF16, ACL_INT32};
use fsdpturbo::backend::ascend::aclnn::mc2::Exchange;
use fsdpturbo::backend::ascend::aclnn::{Aclnn, View};
use fsdpturbo::comm::hccl::{HcclCollective, root_info};
use fsdpturbo::error::ErrorKind;

fn setup() -> std::sync::MutexGuard<'static, ()> {
    let guard = doubles::lock();
    doubles::use_doubles(&doubles::dir().join("libopapi.so"));
    guard
}

fn i32_view<'a>(dims: &'a [i64], strides: &'a [i64], data: &'a mut [i32]) -> View<'a> {
    View {
        dtype: ACL_INT32,
        dims,
        strides,
        offset: 0,
        storage_len: data.len() as i64,
        storage: data.as_mut_ptr().cast(),
    }
}

#[test]
fn token_permute_and_unpermute_follow_the_sorted_indices_contract() {
    let _g = setup();
    let api = Aclnn::get().unwrap();
    let log = doubles::fresh_log("moe");
    let st = stream();
    let (t, k, h) = (3usize, 2usize, 2usize);
    let mut tokens: Vec<f32> = (0..t * h).map(|i| i as f32 + 1.0).collect();
    let mut ids = vec![2i32, 0, 1, 2, 0, 1]; // token 0 → experts 2, 0; token 1 → 1, 2; token 2 → 0, 1
    let mut permuted = vec![f32::NAN; t * k * h];
    let mut sorted = vec![-1i32; t * k];
    let mut host = Host { buffers: vec![] };
    let (td, ts, id, is) = ([t as i64, h as i64], [h as i64, 1], [t as i64, k as i64], [k as i64, 1]);
    let (pd, ps, sd, ss) = ([(t * k) as i64, h as i64], [h as i64, 1], [(t * k) as i64], [1i64]);
    unsafe {
        api.token_permute(
            &f32_view(&td, &ts, 0, &mut tokens),
            &i32_view(&id, &is, &mut ids),
            &f32_view(&pd, &ps, 0, &mut permuted),
            &i32_view(&sd, &ss, &mut sorted),
            &mut |b| host.workspace(b),
            st.0,
        )
    }
    .unwrap();
    // Stable order by expert: slots 1 (e0), 4 (e0), 2 (e1), 5 (e1), 0 (e2), 3 (e2); sorted_indices
    // holds each slot's row, the inverse of that order.
    assert_eq!(sorted, vec![4, 0, 2, 5, 1, 3]);
    let rows: Vec<usize> = vec![1, 4, 2, 5, 0, 3];
    for (row, slot) in rows.iter().enumerate() {
        assert_eq!(&permuted[row * h..(row + 1) * h], &tokens[(slot / k) * h..(slot / k + 1) * h]);
    }

    let mut probs = vec![0.5f32, 0.25, 1.0, -1.0, 2.0, 0.0];
    let mut out = vec![f32::NAN; t * h];
    let (od, os) = ([t as i64, h as i64], [h as i64, 1]);
    unsafe {
        api.token_unpermute(
            &f32_view(&pd, &ps, 0, &mut permuted),
            &i32_view(&sd, &ss, &mut sorted),
            Some(&f32_view(&id, &is, 0, &mut probs)),
            &f32_view(&od, &os, 0, &mut out),
            &mut |b| host.workspace(b),
            st.0,
        )
    }
    .unwrap();
    for tok in 0..t {
        let weight: f32 = probs[tok * k..(tok + 1) * k].iter().sum();
        for c in 0..h {
            assert_eq!(out[tok * h + c], tokens[tok * h + c] * weight, "out[{tok},{c}]");
        }
    }
    // Without probs, K is 1: the rows go back to their slots.
    let mut back = vec![f32::NAN; t * k * h];
    let (bd, bs) = ([(t * k) as i64, h as i64], [h as i64, 1]);
    unsafe {
        api.token_unpermute(
            &f32_view(&pd, &ps, 0, &mut permuted),
            &i32_view(&sd, &ss, &mut sorted),
            None,
            &f32_view(&bd, &bs, 0, &mut back),
            &mut |b| host.workspace(b),
            st.0,
        )
    }
    .unwrap();
    for slot in 0..t * k {
        assert_eq!(&back[slot * h..(slot + 1) * h], &tokens[(slot / k) * h..(slot / k + 1) * h]);
    }
    assert_eq!(live_objects(), 0);
    let lines = normalize(&doubles::read_log(&log));
    assert_eq!(
        lines[..8],
        [
            "aclrtCreateStream S1",
            "aclCreateTensor T1 dtype=0 dims=[3,2] strides=[2,1] offset=0 format=2 storage=[6]",
            "aclCreateTensor T2 dtype=3 dims=[3,2] strides=[2,1] offset=0 format=2 storage=[6]",
            "aclCreateTensor T3 dtype=0 dims=[6,2] strides=[2,1] offset=0 format=2 storage=[12]",
            "aclCreateTensor T4 dtype=3 dims=[6] strides=[1] offset=0 format=2 storage=[6]",
            "aclnnMoeTokenPermuteGetWorkspaceSize tokens=T1 indices=T2 numOutTokens=0 paddedMode=0 \
             permuteTokensOut=T3 sortedIndicesOut=T4 -> workspace=176 E1",
            "aclnnMoeTokenPermute workspace=176 E1 stream=S1",
            "aclDestroyTensor T4",
        ],
        "{lines:#?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("aclnnMoeTokenUnpermuteGetWorkspaceSize") && l.contains("probs=NULL"))
    );
    assert!(!lines.iter().any(|l| l.starts_with("VIOLATION")), "{lines:#?}");
}

fn bf16(x: f32) -> u16 {
    let u = x.to_bits();
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

fn from_bf16(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

fn bf16_view<'a>(dims: &'a [i64], strides: &'a [i64], data: &'a mut [u16]) -> View<'a> {
    View {
        dtype: ACL_BF16,
        dims,
        strides,
        offset: 0,
        storage_len: data.len() as i64,
        storage: data.as_mut_ptr().cast(),
    }
}

const RANKS: usize = 2;
const LOCAL: usize = 2;
const K_IN: usize = 4;
const N_MID: usize = 3;
const N_OUT: usize = 4;

/// Rows rank `s` sends to each global expert (rank-major).
fn sends(s: usize) -> Vec<i64> {
    [vec![1, 2, 0, 3], vec![2, 0, 1, 1]][s].clone()
}

fn value(seed: usize, i: usize) -> f32 {
    from_bf16(bf16(((seed * 31 + i * 7) % 13) as f32 * 0.125 - 0.75))
}

/// Weight `which` of local expert j on rank r, element (n, k) of [N, K] (transposed layout).
fn weight(which: usize, r: usize, j: usize, n: usize, k: usize, kk: usize) -> f32 {
    value(100 * which + 10 * r + j, n * kk + k)
}

#[test]
fn mc2_operators_move_rows_to_their_experts_and_back() {
    let _g = setup();
    let log = doubles::fresh_log("mc2");
    let root = root_info().unwrap();
    let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..RANKS)
            .map(|r| {
                let root = root.clone();
                scope.spawn(move || {
                    let comm = HcclCollective::new(&root, RANKS, r).unwrap();
                    let name = CString::new(comm.name().unwrap()).unwrap();
                    let api = Aclnn::get().unwrap();
                    let st = stream();
                    let send = sends(r);
                    let recv: Vec<i64> =
                        (0..RANKS).flat_map(|s| sends(s)[r * LOCAL..(r + 1) * LOCAL].to_vec()).collect();
                    let (rows, received) =
                        (send.iter().sum::<i64>() as usize, recv.iter().sum::<i64>() as usize);
                    let mut x: Vec<u16> = (0..rows * K_IN).map(|i| bf16(value(r, i))).collect();
                    let mut w1: Vec<u16> = (0..LOCAL * N_MID * K_IN)
                        .map(|i| bf16(weight(1, r, i / (N_MID * K_IN), i / K_IN % N_MID, i % K_IN, K_IN)))
                        .collect();
                    let mut w2: Vec<u16> = (0..LOCAL * N_OUT * N_MID)
                        .map(|i| bf16(weight(2, r, i / (N_OUT * N_MID), i / N_MID % N_OUT, i % N_MID, N_MID)))
                        .collect();
                    let (mut mid, mut permuted) = (vec![0u16; received * N_MID], vec![0u16; received * K_IN]);
                    let mut out = vec![0u16; rows * N_OUT];
                    let mut host = Host { buffers: vec![] };
                    let forward = Exchange {
                        group: &name,
                        ep_world_size: RANKS as i64,
                        send_counts: &send,
                        recv_counts: &recv,
                        trans_weight: true,
                    };
                    let (xd, xs) = ([rows as i64, K_IN as i64], [K_IN as i64, 1]);
                    let (w1d, w1s) =
                        ([LOCAL as i64, N_MID as i64, K_IN as i64], [(N_MID * K_IN) as i64, K_IN as i64, 1]);
                    let (md, ms) = ([received as i64, N_MID as i64], [N_MID as i64, 1]);
                    let (pd, ps) = ([received as i64, K_IN as i64], [K_IN as i64, 1]);
                    unsafe {
                        api.alltoallv_grouped_mm(
                            &bf16_view(&xd, &xs, &mut x),
                            &bf16_view(&w1d, &w1s, &mut w1),
                            &forward,
                            &bf16_view(&md, &ms, &mut mid),
                            Some(&bf16_view(&pd, &ps, &mut permuted)),
                            &mut |b| host.workspace(b),
                            st.0,
                        )
                    }
                    .unwrap();
                    let back = Exchange { send_counts: &recv, recv_counts: &send, ..forward };
                    let (w2d, w2s) = (
                        [LOCAL as i64, N_OUT as i64, N_MID as i64],
                        [(N_OUT * N_MID) as i64, N_MID as i64, 1],
                    );
                    let (od, os) = ([rows as i64, N_OUT as i64], [N_OUT as i64, 1]);
                    unsafe {
                        api.grouped_mm_alltoallv(
                            &bf16_view(&md, &ms, &mut mid),
                            &bf16_view(&w2d, &w2s, &mut w2),
                            &back,
                            &bf16_view(&od, &os, &mut out),
                            &mut |b| host.workspace(b),
                            st.0,
                        )
                    }
                    .unwrap();
                    (
                        permuted.iter().map(|&b| from_bf16(b)).collect(),
                        out.iter().map(|&b| from_bf16(b)).collect(),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Expected, per sending rank s and row i: its expert g = r·L + j (from the send counts);
    // the permuted rows on rank r are ordered local expert j, then source s, then row.
    for r in 0..RANKS {
        let mut want_permuted = vec![];
        for j in 0..LOCAL {
            for s in 0..RANKS {
                let send = sends(s);
                let start: i64 = send[..r * LOCAL + j].iter().sum();
                for i in start..start + send[r * LOCAL + j] {
                    want_permuted.extend((0..K_IN).map(|c| value(s, i as usize * K_IN + c)));
                }
            }
        }
        assert_eq!(results[r].0, want_permuted, "permute_out on rank {r}");
    }
    for (s, (_, out)) in results.iter().enumerate() {
        let send = sends(s);
        let mut at = 0usize;
        for (g, &n) in send.iter().enumerate() {
            let (r, j) = (g / LOCAL, g % LOCAL);
            for i in at..at + n as usize {
                let row: Vec<f32> = (0..K_IN).map(|c| value(s, i * K_IN + c)).collect();
                let mid: Vec<f32> = (0..N_MID)
                    .map(|m| from_bf16(bf16((0..K_IN).map(|c| row[c] * weight(1, r, j, m, c, K_IN)).sum())))
                    .collect();
                for o in 0..N_OUT {
                    let want: f32 = (0..N_MID).map(|m| mid[m] * weight(2, r, j, o, m, N_MID)).sum();
                    let got = out[i * N_OUT + o];
                    assert!(
                        (got - want).abs() <= 0.02 * want.abs().max(1.0),
                        "rank {s} row {i} out {o}: {got} vs {want}"
                    );
                }
            }
            at += n as usize;
        }
    }
    let lines = doubles::read_log(&log);
    assert!(!lines.iter().any(|l| l.starts_with("VIOLATION")), "{lines:#?}");
    let gets: Vec<_> = lines.iter().filter(|l| l.contains("GetWorkspaceSize")).collect();
    assert_eq!(gets.len(), 4, "{gets:#?}");
    assert!(
        gets.iter().any(|l| l.starts_with("aclnnAlltoAllvGroupedMatMulGetWorkspaceSize")
            && l.contains(
                "epWorldSize=2 sendCounts=[1,2,0,3] recvCounts=[1,2,2,0] transGmmWeight=1 permuteOutFlag=1"
            )),
        "{gets:#?}"
    );
    assert!(
        gets.iter().any(|l| l.starts_with("aclnnGroupedMatMulAlltoAllvGetWorkspaceSize")
            && l.contains("sendCounts=[0,3,1,1] recvCounts=[2,0,1,1]")),
        "{gets:#?}"
    );
    assert_eq!(lines.iter().filter(|l| l.starts_with("aclCreateIntArray")).count(), 8);
    assert_eq!(lines.iter().filter(|l| l.starts_with("aclDestroyIntArray")).count(), 8);
    assert_eq!(live_objects(), 0);
}

#[test]
fn mc2_and_permute_report_what_is_missing_or_wrong() {
    let _g = setup();
    let d = doubles::dir();
    doubles::use_doubles(&d.join("v4only/libopapi.so"));
    let api = Aclnn::load().unwrap();
    assert!(api.alltoallv_grouped_mm.is_none() && api.token_permute.is_none());
    let (dims, strides, mut data) = ([1i64, 1], [1i64, 1], vec![0u16; 1]);
    let name = CString::new("g").unwrap();
    let exchange =
        Exchange { group: &name, ep_world_size: 1, send_counts: &[1], recv_counts: &[1], trans_weight: true };
    let v = bf16_view(&dims, &strides, &mut data);
    let err = unsafe {
        api.alltoallv_grouped_mm(&v, &v, &exchange, &v, None, &mut |_| unreachable!(), std::ptr::null_mut())
    }
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unavailable);
    assert!(
        err.message.starts_with("no aclnn library has `aclnnAlltoAllvGroupedMatMul`; searched "),
        "{}",
        err.message
    );
    let err = unsafe { api.token_unpermute(&v, &v, None, &v, &mut |_| unreachable!(), std::ptr::null_mut()) }
        .unwrap_err();
    assert!(err.message.starts_with("no aclnn library has `aclnnMoeTokenUnpermute`"), "{}", err.message);

    doubles::use_doubles(&d.join("libopapi.so"));
    let api = Aclnn::load().unwrap();
    let empty = CString::new("").unwrap();
    let exchange = Exchange { group: &empty, ..exchange };
    let err = unsafe {
        api.grouped_mm_alltoallv(&v, &v, &exchange, &v, &mut |_| unreachable!(), std::ptr::null_mut())
    }
    .unwrap_err();
    assert_eq!(
        err.message,
        "aclnnGroupedMatMulAlltoAllv: the communicator name has 0 bytes; 1 to 127 are accepted"
    );
    let unknown = CString::new("no-such-group").unwrap();
    let exchange = Exchange { group: &unknown, ..exchange };
    let st = stream();
    let err = unsafe { api.grouped_mm_alltoallv(&v, &v, &exchange, &v, &mut |_| unreachable!(), st.0) }
        .unwrap_err();
    assert_eq!(
        err.message,
        "aclnnGroupedMatMulAlltoAllvGetWorkspaceSize failed: ACLNN_ERR_PARAM_INVALID (161002)"
    );
    assert_eq!(live_objects(), 0, "descriptors and int arrays of a refused call are released");
}
