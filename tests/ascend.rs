//! The Ascend backends (src/backend/{acl,hccl,aclnn}.rs, src/comm/hccl.rs) against the C test
//! doubles of tests/doubles: loading, missing libraries and symbols, HCCL collectives among
//! three ranks, and grouped matmul with its exact call protocol and real results.

mod doubles;

use doubles::{Host, f32_view, live_objects, normalize, stream};
use fsdpturbo::backend::ascend::acl::{ACL_INT64, Acl};
use fsdpturbo::backend::ascend::aclnn::{Aclnn, View};
use fsdpturbo::backend::ascend::hccl::Hccl;
use fsdpturbo::comm::hccl::{HcclCollective, root_info};
use fsdpturbo::comm::{AllToAllV, Buffers, Collective, CollectiveOp, ReduceOp};
use fsdpturbo::dtype::Dtype;
use fsdpturbo::error::ErrorKind;

fn setup() -> std::sync::MutexGuard<'static, ()> {
    let guard = doubles::lock();
    doubles::use_doubles(&doubles::dir().join("libopapi.so"));
    guard
}

#[test]
fn loaders_find_the_libraries_and_report_what_is_missing() {
    let _g = setup();
    let acl = Acl::load().unwrap();
    assert!(fsdpturbo::backend::ascend::acl::is_test_double(&acl.lib));
    Hccl::load().unwrap();
    assert_eq!(Aclnn::load().unwrap().grouped_mm.version(), 5, "V5 is preferred when present");

    let d = doubles::dir();
    unsafe { std::env::set_var("FSDPTURBO_HCCL_PATH", d.join("absent/libhccl.so")) };
    let err = Hccl::load().err().unwrap();
    assert_eq!(err.kind, ErrorKind::Unavailable);
    assert!(err.message.starts_with("HCCL (libhccl.so) is not available on this host"), "{}", err.message);
    assert!(err.message.contains("FSDPTURBO_HCCL_PATH="), "{}", err.message);

    unsafe { std::env::set_var("FSDPTURBO_HCCL_PATH", d.join("libascendcl.so")) };
    let err = Hccl::load().err().unwrap();
    assert!(err.message.contains("has no symbol `HcclGetRootInfo`"), "{}", err.message);

    unsafe { std::env::set_var("FSDPTURBO_NNOPBASE_PATH", d.join("libascendcl.so")) };
    let err = Aclnn::load().err().unwrap();
    assert!(err.message.contains("has no symbol `aclDestroyAclOpExecutor`"), "{}", err.message);

    unsafe { std::env::set_var("FSDPTURBO_OPAPI_PATH", d.join("libhccl.so")) };
    doubles::use_doubles(&d.join("libhccl.so"));
    let err = Aclnn::load().err().unwrap();
    assert!(err.message.starts_with("no aclnn library has `aclCreateTensor`; searched "), "{}", err.message);
}

#[test]
fn hccl_collectives_among_three_ranks() {
    let _g = setup();
    let log = doubles::fresh_log("collectives");
    let root = root_info().unwrap();
    assert_eq!(root.len(), 4108);
    let bad = HcclCollective::new(&root[..4100], 3, 0).err().unwrap();
    assert!(bad.message.contains("HcclRootInfo is exactly 4108"), "{}", bad.message);
    assert!(
        HcclCollective::new(&root, 3, 3).err().unwrap().message.contains("rank 3 is outside a group of 3")
    );

    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3usize)
            .map(|rank| {
                let root = root.clone();
                s.spawn(move || {
                    let comm = HcclCollective::new(&root, 3, rank).unwrap();
                    assert_eq!((comm.rank(), comm.world_size()), (rank, 3));
                    let refused = comm.all_reduce_host_f64(1.0, ReduceOp::Sum).unwrap_err();
                    assert!(refused.message.contains("cannot reduce a host value"), "{}", refused.message);
                    let st = stream();
                    let r = rank as f32;
                    let send = [r + 1.0, 10.0 * r];
                    let mut sum = [0f32; 2];
                    let mut max = [0f32; 2];
                    let buffers = |send: *const u8, recv: *mut u8, count, dtype| Buffers {
                        send: send.cast(),
                        recv: recv.cast(),
                        count,
                        dtype,
                        stream: st,
                    };
                    let mine = [rank as i64; 2];
                    let mut gathered = [0i64; 6];
                    let blocks: Vec<f64> = (0..3).map(|b| (10 * rank + b) as f64).collect();
                    let mut scattered = [0f64; 1];
                    let ops = [
                        (
                            CollectiveOp::AllReduce(ReduceOp::Sum),
                            buffers(send.as_ptr().cast(), sum.as_mut_ptr().cast(), 2, Dtype::F32),
                        ),
                        (
                            CollectiveOp::AllReduce(ReduceOp::Max),
                            buffers(send.as_ptr().cast(), max.as_mut_ptr().cast(), 2, Dtype::F32),
                        ),
                        (
                            CollectiveOp::AllGather,
                            buffers(mine.as_ptr().cast(), gathered.as_mut_ptr().cast(), 2, Dtype::I64),
                        ),
                        (
                            CollectiveOp::ReduceScatter(ReduceOp::Sum),
                            buffers(blocks.as_ptr().cast(), scattered.as_mut_ptr().cast(), 1, Dtype::F64),
                        ),
                    ];
                    for (op, b) in ops {
                        unsafe { comm.run(op, b) }.unwrap();
                    }
                    // Rank s sends (s + d) % 3 elements to rank d (zero included); values 100s + i.
                    let send_counts: Vec<usize> = (0..3).map(|d| (rank + d) % 3).collect();
                    let recv_counts: Vec<usize> = (0..3).map(|s| (s + rank) % 3).collect();
                    let values: Vec<f32> =
                        (0..send_counts.iter().sum::<usize>()).map(|i| (100 * rank + i) as f32).collect();
                    let layout = AllToAllV::packed(send_counts, recv_counts.clone());
                    let mut received = vec![-1f32; recv_counts.iter().sum()];
                    unsafe {
                        comm.all_to_all_v(
                            values.as_ptr().cast(),
                            received.as_mut_ptr().cast(),
                            &layout,
                            Dtype::F32,
                            st,
                        )
                    }
                    .unwrap();
                    // A rank that expects more than it is sent gets HCCL's error, with its text.
                    let mut wrong = AllToAllV::packed(vec![0; 3], vec![0; 3]);
                    if rank == 1 {
                        wrong.recv_counts[0] = 2;
                        wrong = AllToAllV::packed(wrong.send_counts, wrong.recv_counts);
                    }
                    let mut sink = [0f32; 2];
                    let mismatch = unsafe {
                        comm.all_to_all_v(
                            values.as_ptr().cast(),
                            sink.as_mut_ptr().cast(),
                            &wrong,
                            Dtype::F32,
                            st,
                        )
                    };
                    (sum, max, gathered, scattered, received, mismatch.err().map(|e| e.message))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (sum, max, gathered, scattered, received, mismatch)) in results.into_iter().enumerate() {
        assert_eq!(sum, [6.0, 30.0]);
        assert_eq!(max, [3.0, 20.0]);
        assert_eq!(gathered, [0, 0, 1, 1, 2, 2]);
        assert_eq!(scattered, [(rank + (10 + rank) + (20 + rank)) as f64]);
        // From source s: the block s sent to `rank`, which starts after what s sent to ranks < rank.
        let mut expected = Vec::new();
        for s in 0..3usize {
            let start: usize = (0..rank).map(|d| (s + d) % 3).sum();
            expected.extend((start..start + (s + rank) % 3).map(|i| (100 * s + i) as f32));
        }
        assert_eq!(received, expected, "rank {rank}");
        if rank == 1 {
            let m = mismatch.unwrap();
            assert!(m.starts_with("HcclAlltoAllV failed with HcclResult 1: "), "{m}");
        } else {
            assert!(mismatch.is_none());
        }
    }
    let lines = doubles::read_log(&log);
    let a2av: Vec<_> =
        lines.iter().filter(|l| l.starts_with("HcclAlltoAllV ") && l.contains("rank=1 ")).collect();
    assert!(
        a2av[0].starts_with("HcclAlltoAllV sendCounts=[1,2,0] sdispls=[0,1,3] recvCounts=[1,2,0] rdispls=[0,1,3] dtype=4 rank=1"),
        "{}",
        a2av[0]
    );
    assert!(
        lines.iter().any(|l| l.starts_with("HcclAllReduce count=2 dtype=4 op=2 rank=0")),
        "MAX is HCCL's 2"
    );
    assert!(lines.iter().any(|l| l.starts_with("HcclAllGather count=2 dtype=5 rank=2")), "INT64 is HCCL's 5");
    assert!(
        lines.iter().any(|l| l.starts_with("HcclReduceScatter count=1 dtype=10 op=0")),
        "FP64 is HCCL's 10"
    );
    let violations: Vec<_> = lines.iter().filter(|l| l.starts_with("VIOLATION")).collect();
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].contains("rank 0 sends 0 elements to rank 1, which expects 2"),
        "{}",
        violations[0]
    );
}

fn counts_view<'a>(dims: &'a [i64], strides: &'a [i64], counts: &'a mut [i64]) -> View<'a> {
    View {
        dtype: ACL_INT64,
        dims,
        strides,
        offset: 0,
        storage_len: counts.len() as i64,
        storage: counts.as_mut_ptr().cast(),
    }
}

#[test]
fn grouped_mm_calls_the_two_phases_in_order_and_computes() {
    let _g = setup();
    let api = Aclnn::get().unwrap();
    let log = doubles::fresh_log("gmm");
    let st = stream();
    let (g, m, k, n) = (3usize, 5usize, 4usize, 3usize);
    let mut counts = vec![2i64, 0, 3];
    // x [M, K] three elements into its storage (an offset that is not ACL_FORMAT_ND's 2, so a swap shows); weight stored [G, N, K] and viewed as [G, K, N].
    let mut x: Vec<f32> = (0..3 + m * k).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut w: Vec<f32> = (0..g * n * k).map(|i| (i as f32 * 0.11).cos()).collect();
    let mut y = vec![f32::NAN; m * n];
    let mut host = Host { buffers: vec![] };
    let (xd, xs) = ([m as i64, k as i64], [k as i64, 1]);
    let (wd, ws) = ([g as i64, k as i64, n as i64], [(n * k) as i64, 1, k as i64]);
    let (yd, ys) = ([m as i64, n as i64], [n as i64, 1]);
    let (cd, cs) = ([g as i64], [1i64]);
    let group = counts_view(&cd, &cs, &mut counts);
    unsafe {
        api.grouped_mm(
            &f32_view(&xd, &xs, 3, &mut x),
            &f32_view(&wd, &ws, 0, &mut w),
            &group,
            &f32_view(&yd, &ys, 0, &mut y),
            2,
            0,
            &mut |b| host.workspace(b),
            st.0,
        )
    }
    .unwrap();
    let group_of = |row: usize| if row < 2 { 0 } else { 2 };
    for i in 0..m {
        for j in 0..n {
            let want: f64 =
                (0..k).map(|c| x[3 + i * k + c] as f64 * w[group_of(i) * n * k + j * k + c] as f64).sum();
            assert!((y[i * n + j] as f64 - want).abs() < 1e-5, "y[{i},{j}] = {} want {want}", y[i * n + j]);
        }
    }
    assert_eq!(host.buffers.len(), 1);
    assert_eq!(host.buffers[0].len(), 256 + 64 * 3);

    // Weight gradient split along K: x^T [K_in, M] (a transposed view) times dY [M, N] → [G, K_in, N].
    let mut dy: Vec<f32> = (0..m * n).map(|i| i as f32 - 4.0).collect();
    let mut dw = vec![f32::NAN; g * k * n];
    let (td, ts) = ([k as i64, m as i64], [1i64, k as i64]);
    let (dd, ds) = ([m as i64, n as i64], [n as i64, 1]);
    let (od, os) = ([g as i64, k as i64, n as i64], [(k * n) as i64, n as i64, 1]);
    let group = counts_view(&cd, &cs, &mut counts);
    unsafe {
        api.grouped_mm(
            &f32_view(&td, &ts, 3, &mut x),
            &f32_view(&dd, &ds, 0, &mut dy),
            &group,
            &f32_view(&od, &os, 0, &mut dw),
            3,
            2,
            &mut |b| host.workspace(b),
            st.0,
        )
    }
    .unwrap();
    for e in 0..g {
        let rows: Vec<usize> = (0..m).filter(|&r| group_of(r) == e && counts[e] > 0).collect();
        for a in 0..k {
            for b in 0..n {
                let want: f64 = rows.iter().map(|&r| x[3 + r * k + a] as f64 * dy[r * n + b] as f64).sum();
                assert!((dw[e * k * n + a * n + b] as f64 - want).abs() < 1e-4, "dw[{e},{a},{b}]");
            }
        }
    }

    // A workspace that cannot be allocated: the executor is destroyed, nothing launches.
    let group = counts_view(&cd, &cs, &mut counts);
    let err = unsafe {
        api.grouped_mm(
            &f32_view(&xd, &xs, 3, &mut x),
            &f32_view(&wd, &ws, 0, &mut w),
            &group,
            &f32_view(&yd, &ys, 0, &mut y),
            2,
            0,
            &mut |_| Err(fsdpturbo::error::Error::new(ErrorKind::Unavailable, "out of device memory")),
            st.0,
        )
    }
    .unwrap_err();
    assert_eq!(err.message, "out of device memory");
    // A view past its storage is refused by aclCreateTensor; what was made is destroyed.
    let group = counts_view(&cd, &cs, &mut counts);
    let err = unsafe {
        api.grouped_mm(
            &f32_view(&xd, &xs, 3, &mut x),
            &f32_view(&wd, &ws, 1, &mut w),
            &group,
            &f32_view(&yd, &ys, 0, &mut y),
            2,
            0,
            &mut |b| host.workspace(b),
            st.0,
        )
    }
    .unwrap_err();
    assert!(
        err.message.starts_with("aclCreateTensor refused a view (dtype 0, dims [3, 4, 3]"),
        "{}",
        err.message
    );
    assert_eq!(live_objects(), 0, "every descriptor, list and executor is released");

    let expected = [
        "aclrtCreateStream S1",
        "aclCreateTensor T1 dtype=0 dims=[5,4] strides=[4,1] offset=3 format=2 storage=[23]",
        "aclCreateTensorList L1 [T1]",
        "aclCreateTensor T2 dtype=0 dims=[3,4,3] strides=[12,1,4] offset=0 format=2 storage=[36]",
        "aclCreateTensorList L2 [T2]",
        "aclCreateTensor T3 dtype=9 dims=[3] strides=[1] offset=0 format=2 storage=[3]",
        "aclCreateTensor T4 dtype=0 dims=[5,3] strides=[3,1] offset=0 format=2 storage=[15]",
        "aclCreateTensorList L3 [T4]",
        "aclnnGroupedMatmulV5GetWorkspaceSize x=L1 weight=L2 groupList=T3 splitItem=2 groupType=0 groupListType=1 actType=0 out=L3 -> workspace=448 E1",
        "aclnnGroupedMatmulV5 workspace=448 E1 stream=S1",
        "aclDestroyTensorList L3",
        "aclDestroyTensor T3",
        "aclDestroyTensorList L2",
        "aclDestroyTensorList L1",
        "aclCreateTensor T5 dtype=0 dims=[4,5] strides=[1,4] offset=3 format=2 storage=[23]",
        "aclCreateTensorList L4 [T5]",
        "aclCreateTensor T6 dtype=0 dims=[5,3] strides=[3,1] offset=0 format=2 storage=[15]",
        "aclCreateTensorList L5 [T6]",
        "aclCreateTensor T7 dtype=9 dims=[3] strides=[1] offset=0 format=2 storage=[3]",
        "aclCreateTensor T8 dtype=0 dims=[3,4,3] strides=[12,3,1] offset=0 format=2 storage=[36]",
        "aclCreateTensorList L6 [T8]",
        "aclnnGroupedMatmulV5GetWorkspaceSize x=L4 weight=L5 groupList=T7 splitItem=3 groupType=2 groupListType=1 actType=0 out=L6 -> workspace=448 E2",
        "aclnnGroupedMatmulV5 workspace=448 E2 stream=S1",
        "aclDestroyTensorList L6",
        "aclDestroyTensor T7",
        "aclDestroyTensorList L5",
        "aclDestroyTensorList L4",
        "aclCreateTensor T9 dtype=0 dims=[5,4] strides=[4,1] offset=3 format=2 storage=[23]",
        "aclCreateTensorList L7 [T9]",
        "aclCreateTensor T10 dtype=0 dims=[3,4,3] strides=[12,1,4] offset=0 format=2 storage=[36]",
        "aclCreateTensorList L8 [T10]",
        "aclCreateTensor T11 dtype=9 dims=[3] strides=[1] offset=0 format=2 storage=[3]",
        "aclCreateTensor T12 dtype=0 dims=[5,3] strides=[3,1] offset=0 format=2 storage=[15]",
        "aclCreateTensorList L9 [T12]",
        "aclnnGroupedMatmulV5GetWorkspaceSize x=L7 weight=L8 groupList=T11 splitItem=2 groupType=0 groupListType=1 actType=0 out=L9 -> workspace=448 E3",
        "aclDestroyAclOpExecutor E3",
        "aclDestroyTensorList L9",
        "aclDestroyTensor T11",
        "aclDestroyTensorList L8",
        "aclDestroyTensorList L7",
        "aclCreateTensor T13 dtype=0 dims=[5,4] strides=[4,1] offset=3 format=2 storage=[23]",
        "aclCreateTensorList L10 [T13]",
        "VIOLATION aclCreateTensor: the view reaches element 36 of a storage of 36 elements",
        "aclDestroyTensorList L10",
    ];
    assert_eq!(normalize(&doubles::read_log(&log)), expected);
}
