//! The shared run-time loader (src/backend/mod.rs), the one-rank collective (src/comm/mod.rs) and
//! the host-callback transport (src/comm/host.rs).

use std::ffi::c_void;
use std::path::PathBuf;

use fsdpturbo::backend::{LibrarySpec, add_search_dirs, load};
use fsdpturbo::comm::host::HostCallbacks;
use fsdpturbo::comm::{AllToAllV, Buffers, Collective, CollectiveOp, ReduceOp, SingleRank, Stream};
use fsdpturbo::dtype::Dtype;
use fsdpturbo::error::ErrorKind;

fn spec(env_var: &'static str, file_names: &'static [&'static str]) -> LibrarySpec {
    LibrarySpec { what: "Test library", env_var, file_names, extra_dirs: LibrarySpec::no_extra_dirs }
}

#[test]
fn loads_through_the_system_loader_and_resolves_symbols() {
    let libc = load(&spec("FSDPTURBO_TEST_UNSET_PATH", &["libc.so.6"])).unwrap();
    type Strlen = unsafe extern "C" fn(*const std::ffi::c_char) -> usize;
    let strlen: Strlen = unsafe { libc.required("strlen") }.unwrap();
    assert_eq!(unsafe { strlen(c"four".as_ptr()) }, 4);
    assert!(unsafe { libc.optional::<Strlen>("no_such_symbol_fsdpturbo") }.is_none());
    let err = unsafe { libc.required::<Strlen>("no_such_symbol_fsdpturbo") }.err().unwrap();
    assert_eq!(err.kind, ErrorKind::Unavailable);
    assert!(err.message.contains("`no_such_symbol_fsdpturbo`"), "{}", err.message);
    assert!(err.message.contains("libc.so.6"), "{}", err.message);
}

#[test]
fn a_missing_library_lists_everything_tried() {
    let dir = std::env::temp_dir().join("fsdpturbo-backend-test-dir");
    std::fs::create_dir_all(&dir).unwrap();
    add_search_dirs([dir.clone()]);
    let err = load(&spec("FSDPTURBO_TEST_UNSET_PATH", &["libfsdpturbo_absent.so.9"])).err().unwrap();
    assert_eq!(err.kind, ErrorKind::Unavailable);
    let m = &err.message;
    assert!(
        m.starts_with("Test library is not available on this host; tried: FSDPTURBO_TEST_UNSET_PATH (unset)"),
        "{m}"
    );
    assert!(m.contains(&format!("{} (not found)", dir.join("libfsdpturbo_absent.so.9").display())), "{m}");
    assert!(m.contains("libfsdpturbo_absent.so.9 through the system loader"), "{m}");
    assert!(m.ends_with("Set FSDPTURBO_TEST_UNSET_PATH to the library file"), "{m}");
}

#[test]
fn an_explicit_path_is_used_alone() {
    // SAFETY: set once, read by this test only (unique variable name).
    unsafe { std::env::set_var("FSDPTURBO_TEST_EXPLICIT_PATH", "/nonexistent/libx.so") };
    let err = load(&spec("FSDPTURBO_TEST_EXPLICIT_PATH", &["libc.so.6"])).err().unwrap();
    assert!(err.message.contains("FSDPTURBO_TEST_EXPLICIT_PATH=/nonexistent/libx.so"), "{}", err.message);
    assert!(!err.message.contains("system loader"), "no fallback once the variable is set: {}", err.message);
}

/// The directory of the libc.so.6 mapped into this process, named as the kernel names the file
/// (/proc/self/maps), wherever the target and the distribution put it. (Under qemu-user the
/// dynamic loader's own name for it, e.g. /lib/libc.so.6, is a path qemu redirects into the
/// cross sysroot when a file is opened but not when its metadata is read: `exists()` denies it.)
fn libc_dir() -> PathBuf {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps is readable");
    let file = maps
        .lines()
        .filter_map(|mapping| mapping.split_whitespace().nth(5))
        .find(|file| file.ends_with("/libc.so.6"))
        .unwrap_or_else(|| panic!("no libc.so.6 among the mappings of this process:\n{maps}"));
    PathBuf::from(file).parent().unwrap().to_path_buf()
}

#[test]
fn a_found_file_in_a_search_dir_wins() {
    let dir = libc_dir();
    add_search_dirs([dir.clone()]);
    let loaded = load(&spec("FSDPTURBO_TEST_UNSET_PATH", &["libc.so.6"])).unwrap();
    assert_eq!(loaded.path(), dir.join("libc.so.6"));
}

/// Host buffers of `count` elements of `dtype` per rank.
fn host(send: *const c_void, recv: *mut c_void, count: usize, dtype: Dtype) -> Buffers {
    Buffers { send, recv, count, dtype, stream: Stream::HOST }
}

#[test]
fn single_rank_collectives_copy() {
    let one = SingleRank;
    assert_eq!((one.rank(), one.world_size()), (0, 1));
    let send = [1.0f32, 2.0, 3.0, 4.0];
    let mut recv = [0.0f32; 4];
    unsafe {
        one.run(
            CollectiveOp::AllReduce(ReduceOp::Sum),
            host(send.as_ptr().cast(), recv.as_mut_ptr().cast(), 4, Dtype::F32),
        )
    }
    .unwrap();
    assert_eq!(recv, send);
    let layout =
        AllToAllV { send_counts: vec![2], send_displs: vec![1], recv_counts: vec![2], recv_displs: vec![2] };
    let mut out = [0.0f32; 4];
    unsafe {
        one.all_to_all_v(
            send.as_ptr().cast(),
            out.as_mut_ptr().cast::<c_void>(),
            &layout,
            Dtype::F32,
            Stream::HOST,
        )
    }
    .unwrap();
    assert_eq!(out, [0.0, 0.0, 2.0, 3.0]);
    let bad = AllToAllV::packed(vec![2], vec![3]);
    let err = unsafe {
        one.all_to_all_v(send.as_ptr().cast(), out.as_mut_ptr().cast(), &bad, Dtype::F32, Stream::HOST)
    };
    assert!(err.unwrap_err().message.contains("sends 2 elements to itself but expects to receive 3"));
    let short = AllToAllV::packed(vec![], vec![]);
    assert!(
        short.check(2).unwrap_err().message.contains("`send_counts` has 0 entries; the group has 2 ranks")
    );
    assert_eq!(AllToAllV::packed(vec![3, 0, 2], vec![1, 1, 1]).send_displs, vec![0, 3, 3]);
    let mut gathered = [0.0f32; 4];
    unsafe {
        one.run(
            CollectiveOp::AllGather,
            host(send.as_ptr().cast(), gathered.as_mut_ptr().cast(), 4, Dtype::F32),
        )
    }
    .unwrap();
    assert_eq!(gathered, send);
    let mut scattered = [0.0f32; 4];
    unsafe {
        one.run(
            CollectiveOp::ReduceScatter(ReduceOp::Min),
            host(send.as_ptr().cast(), scattered.as_mut_ptr().cast(), 4, Dtype::F32),
        )
    }
    .unwrap();
    assert_eq!(scattered, send);
}

/// Rank 1 of two, whose peer (rank 0) holds `[100, 200]` for every collective.
fn host_rank_one(with_optional: bool) -> HostCallbacks {
    let peer = [100.0f64, 200.0];
    HostCallbacks {
        rank: 1,
        world_size: 2,
        all_reduce: Box::new(|_, _, _, _, _| 3),
        all_gather: with_optional.then(|| {
            Box::new(move |s: *const c_void, r: *mut c_void, n: usize, d: Dtype| {
                assert_eq!((n, d), (2, Dtype::F64));
                let (s, r) = unsafe { (std::slice::from_raw_parts(s.cast::<f64>(), n), r.cast::<f64>()) };
                let r = unsafe { std::slice::from_raw_parts_mut(r, 2 * n) };
                r[..n].copy_from_slice(&peer);
                r[n..].copy_from_slice(s);
                0
            }) as _
        }),
        reduce_scatter: with_optional.then(|| {
            Box::new(move |s: *const c_void, r: *mut c_void, n: usize, d: Dtype, o: ReduceOp| {
                assert_eq!((n, d, o), (2, Dtype::F64, ReduceOp::Sum));
                let s = unsafe { std::slice::from_raw_parts(s.cast::<f64>(), 2 * n) };
                let r = unsafe { std::slice::from_raw_parts_mut(r.cast::<f64>(), n) };
                for i in 0..n {
                    r[i] = s[n + i] + peer[i];
                }
                0
            }) as _
        }),
        all_to_all_v: None,
    }
}

#[test]
fn host_callbacks_gather_scatter_and_name_what_is_missing() {
    let comm = host_rank_one(true);
    let mine = [1.0f64, 2.0];
    let mut gathered = [0.0f64; 4];
    unsafe {
        comm.run(
            CollectiveOp::AllGather,
            host(mine.as_ptr().cast(), gathered.as_mut_ptr().cast(), 2, Dtype::F64),
        )
    }
    .unwrap();
    assert_eq!(gathered, [100.0, 200.0, 1.0, 2.0]);
    let blocks = [9.0f64, 9.0, 1.0, 2.0];
    let mut out = [0.0f64; 2];
    unsafe {
        comm.run(
            CollectiveOp::ReduceScatter(ReduceOp::Sum),
            host(blocks.as_ptr().cast(), out.as_mut_ptr().cast(), 2, Dtype::F64),
        )
    }
    .unwrap();
    assert_eq!(out, [101.0, 202.0]);
    let err = comm.all_reduce_host_f64(1.0, ReduceOp::Sum).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unavailable);
    assert_eq!(err.message, "the embedder's all_reduce callback failed with status 3 on rank 1");

    let bare = host_rank_one(false);
    let err = unsafe {
        bare.run(
            CollectiveOp::AllGather,
            host(mine.as_ptr().cast(), gathered.as_mut_ptr().cast(), 2, Dtype::F64),
        )
    }
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unavailable);
    assert_eq!(
        err.message,
        "this host communicator has no `all_gather` callback (`fsdpturbo_host_collective_t.all_gather` \
         was NULL when it was made); pass one to fsdpturbo_comm_host_new to use all_gather"
    );
    let err = unsafe {
        bare.run(
            CollectiveOp::ReduceScatter(ReduceOp::Sum),
            host(blocks.as_ptr().cast(), out.as_mut_ptr().cast(), 2, Dtype::F64),
        )
    }
    .unwrap_err();
    assert!(
        err.message.starts_with("this host communicator has no `reduce_scatter` callback"),
        "{}",
        err.message
    );
    let layout = AllToAllV::packed(vec![1, 1], vec![1, 1]);
    let err = unsafe {
        bare.all_to_all_v(mine.as_ptr().cast(), out.as_mut_ptr().cast(), &layout, Dtype::F64, Stream::HOST)
    }
    .unwrap_err();
    assert!(
        err.message.starts_with("this host communicator has no `all_to_all_v` callback"),
        "{}",
        err.message
    );
}
