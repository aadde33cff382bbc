//! The parallel state: `ParallelState` values, the process-global state (initialise once,
//! idempotent re-init, the seed's error on a different topology, reset, thread safety), and the
//! C ABI of `ffi/state.rs`.
//!
//! Tests in this file share the process-global state, so each one holds `serial()`.

use std::ffi::CString;
use std::ptr;
use std::sync::{Arc, Barrier, Mutex, MutexGuard};
use std::thread;

use fsdpturbo::error::ErrorKind;
use fsdpturbo::ffi::state::*;
use fsdpturbo::ffi::status::*;
use fsdpturbo::ffi::topology::*;
use fsdpturbo::state::{ParallelState, global_state, initialize_global, reset_global_state};
use fsdpturbo::topology::{Topology, TopologySpec};

mod common;
use common::{last_error, topology_options};

static SERIAL: Mutex<()> = Mutex::new(());

/// Serialises the tests of this file and starts each from an empty global state.
fn serial() -> MutexGuard<'static, ()> {
    let guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    reset_global_state();
    guard
}

fn topo(world: u64, cp: u64, ep: u64) -> Topology {
    Topology::new(&TopologySpec { world_size: world, cp_size: cp, ep_size: ep, ..TopologySpec::default() })
        .unwrap()
}

#[test]
fn parallel_state_holds_the_meshes() {
    let t = topo(16, 2, 4);
    let s = ParallelState::new(t.clone());
    assert_eq!(s.topology(), &t);
    assert_eq!(s.data_mesh(), &t.data_mesh());
    assert_eq!(s.model_mesh(), &t.model_mesh());
    assert_eq!(s.expert_mesh(), t.expert_mesh().as_ref());
    assert_eq!(s.expert_mesh().unwrap().shape, vec![1, 2, 4, 2]);
    assert_eq!(s.key(), (8, 2, 4));
    let plain = ParallelState::new(topo(8, 1, 1));
    assert!(plain.expert_mesh().is_none());
}

#[test]
fn initialise_once_then_idempotent() {
    let _g = serial();
    assert!(global_state().is_none());
    let first = initialize_global(topo(16, 1, 8)).unwrap();
    let again = initialize_global(topo(16, 1, 8)).unwrap();
    assert!(Arc::ptr_eq(&first, &again), "same topology must return the same state");
    assert!(Arc::ptr_eq(&first, &global_state().unwrap()));
    assert_eq!(first.expert_mesh().unwrap().shape, vec![1, 2, 8, 1]);
}

#[test]
fn different_topology_is_the_seed_error() {
    let _g = serial();
    let first = initialize_global(topo(16, 2, 4)).unwrap();
    let err = initialize_global(topo(16, 1, 1)).unwrap_err();
    assert_eq!(err.kind, ErrorKind::State);
    assert_eq!(
        err.message,
        "FSDPTurbo parallel state is already initialized with (8, 2, 4), got (16, 1, 1). \
         The topologies differ in dp_size (8, got 16), cp_size (2, got 1), ep_size (4, got 1), \
         efsdp_size (2, got 1). Reset the state first (reset_global_state, C: fsdpturbo_state_reset) \
         to initialize it with another topology."
    );
    // Nothing changed.
    assert!(Arc::ptr_eq(&first, &global_state().unwrap()));
}

#[test]
fn difference_outside_the_seed_key_is_still_an_error() {
    let _g = serial();
    initialize_global(topo(16, 2, 4)).unwrap();
    let other = Topology::new(&TopologySpec {
        world_size: 16,
        cp_size: 2,
        ep_size: 4,
        mp_replicate_size: 2,
        ..TopologySpec::default()
    })
    .unwrap();
    assert_eq!(other.key(), (8, 2, 4));
    let err = initialize_global(other).unwrap_err();
    assert_eq!(err.kind, ErrorKind::State);
    assert!(
        err.message.starts_with(
            "FSDPTurbo parallel state is already initialized with (8, 2, 4), got (8, 2, 4). \
             The topologies differ in mp_replicate_size (1, got 2), mp_shard_size (16, got 8)."
        ),
        "{}",
        err.message
    );
    let replicated = Topology::new(&TopologySpec {
        world_size: 16,
        cp_size: 2,
        ep_size: 4,
        efsdp_size: Some(1),
        ..TopologySpec::default()
    })
    .unwrap();
    let err = initialize_global(replicated).unwrap_err();
    assert!(err.message.contains("differ in efsdp_size (2, got 1), edp_size (1, got 2)."), "{}", err.message);
    assert_eq!(global_state().unwrap().topology(), &topo(16, 2, 4));
}

#[test]
fn reset_allows_another_topology_and_keeps_old_arcs() {
    let _g = serial();
    let old = initialize_global(topo(16, 1, 8)).unwrap();
    reset_global_state();
    assert!(global_state().is_none());
    reset_global_state(); // resetting an empty state is fine
    let new = initialize_global(topo(8, 2, 2)).unwrap();
    assert!(!Arc::ptr_eq(&old, &new));
    assert_eq!(old.key(), (16, 1, 8));
    assert_eq!(global_state().unwrap().key(), (4, 2, 2));
}

#[test]
fn inconsistent_hand_built_topology_is_rejected() {
    let _g = serial();
    let bad = Topology { edp_size: 2, ..topo(16, 2, 4) };
    let err = initialize_global(bad).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Topology);
    assert!(global_state().is_none());
}

#[test]
fn sixteen_threads_same_topology_share_one_state() {
    let _g = serial();
    for _round in 0..20 {
        reset_global_state();
        let barrier = Arc::new(Barrier::new(16));
        let handles: Vec<_> = (0..16)
            .map(|_| {
                let barrier = Arc::clone(&barrier);
                thread::spawn(move || {
                    barrier.wait();
                    initialize_global(topo(16, 2, 4)).unwrap()
                })
            })
            .collect();
        let states: Vec<Arc<ParallelState>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let global = global_state().unwrap();
        assert!(states.iter().all(|s| Arc::ptr_eq(s, &global)));
    }
}

#[test]
fn sixteen_threads_distinct_topologies_exactly_one_wins() {
    let _g = serial();
    // 16 distinct topologies of world 16 (ep × mp_replicate).
    let mut topologies = Vec::new();
    for ep in [1, 2, 4, 8] {
        for r in [1, 2, 4, 8] {
            topologies.push(
                Topology::new(&TopologySpec {
                    world_size: 16,
                    ep_size: ep,
                    mp_replicate_size: r,
                    ..TopologySpec::default()
                })
                .unwrap(),
            );
        }
    }
    for _round in 0..20 {
        reset_global_state();
        let barrier = Arc::new(Barrier::new(16));
        let handles: Vec<_> = topologies
            .iter()
            .cloned()
            .map(|t| {
                let barrier = Arc::clone(&barrier);
                thread::spawn(move || {
                    barrier.wait();
                    initialize_global(t)
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let winners: Vec<&Arc<ParallelState>> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert_eq!(winners.len(), 1);
        let global = global_state().unwrap();
        assert!(Arc::ptr_eq(winners[0], &global));
        let (dp, cp, ep) = global.key();
        for err in results.iter().filter_map(|r| r.as_ref().err()) {
            assert_eq!(err.kind, ErrorKind::State);
            let prefix =
                format!("FSDPTurbo parallel state is already initialized with ({dp}, {cp}, {ep}), got (");
            assert!(err.message.starts_with(&prefix), "{}", err.message);
        }
    }
}

#[test]
fn sixteen_threads_two_topologies_one_group_wins() {
    let _g = serial();
    for _round in 0..20 {
        reset_global_state();
        let barrier = Arc::new(Barrier::new(16));
        let handles: Vec<_> = (0..16u64)
            .map(|i| {
                let barrier = Arc::clone(&barrier);
                thread::spawn(move || {
                    barrier.wait();
                    initialize_global(topo(16, 1, if i % 2 == 0 { 8 } else { 4 }))
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let global = global_state().unwrap();
        let ok: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert_eq!(ok.len(), 8);
        assert!(ok.iter().all(|s| Arc::ptr_eq(s, &global)));
        assert_eq!(
            results.iter().filter(|r| r.as_ref().is_err_and(|e| e.kind == ErrorKind::State)).count(),
            8
        );
    }
}

// ---------------------------------------------------------------------------------------------
// C ABI

fn new_topology(world: u64, cp: u64, ep: u64) -> *mut fsdpturbo_topology_t {
    let mut out = ptr::null_mut();
    assert_eq!(
        fsdpturbo_topology_new(&topology_options(world, cp, ep), &mut out),
        FSDPTURBO_OK,
        "{}",
        last_error()
    );
    out
}

fn size(h: *const fsdpturbo_topology_t, dim: &str) -> u64 {
    let dim = CString::new(dim).unwrap();
    let mut out = 0;
    assert_eq!(fsdpturbo_topology_size(h, dim.as_ptr(), &mut out), FSDPTURBO_OK, "{}", last_error());
    out
}

#[test]
fn ffi_state_lifecycle() {
    let _g = serial();
    let mut out = ptr::dangling_mut::<fsdpturbo_topology_t>();
    assert_eq!(fsdpturbo_state_get(&mut out), FSDPTURBO_ERR_STATE);
    assert!(out.is_null());
    assert_eq!(
        last_error(),
        "the FSDPTurbo parallel state is not initialized; call fsdpturbo_state_initialize first"
    );
    assert_eq!(fsdpturbo_state_get(ptr::null_mut()), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(fsdpturbo_state_initialize(ptr::null()), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `topology` must not be NULL");

    let t = new_topology(16, 2, 4);
    assert_eq!(fsdpturbo_state_initialize(t), FSDPTURBO_OK);
    assert_eq!(fsdpturbo_state_initialize(t), FSDPTURBO_OK, "same topology again is a no-op");
    fsdpturbo_topology_free(t); // the state keeps its own copy
    assert_eq!(global_state().unwrap().key(), (8, 2, 4));

    let mut got = ptr::null_mut();
    assert_eq!(fsdpturbo_state_get(&mut got), FSDPTURBO_OK);
    assert!(!got.is_null());
    assert_eq!((size(got, "dp"), size(got, "cp"), size(got, "ep"), size(got, "efsdp")), (8, 2, 4, 2));
    let mut got2 = ptr::null_mut();
    assert_eq!(fsdpturbo_state_get(&mut got2), FSDPTURBO_OK);
    assert_ne!(got, got2, "every call makes a new handle");
    fsdpturbo_topology_free(got2);

    let other = new_topology(16, 1, 8);
    assert_eq!(fsdpturbo_state_initialize(other), FSDPTURBO_ERR_STATE);
    let message = last_error();
    assert!(
        message
            .starts_with("FSDPTurbo parallel state is already initialized with (8, 2, 4), got (16, 1, 8)."),
        "{message}"
    );
    // Reset keeps the last error (cleanup after a failure), then allows the other topology.
    fsdpturbo_state_reset();
    assert_eq!(last_error(), message);
    assert!(global_state().is_none());
    let mut none = ptr::null_mut();
    assert_eq!(fsdpturbo_state_get(&mut none), FSDPTURBO_ERR_STATE);
    assert_eq!(fsdpturbo_state_initialize(other), FSDPTURBO_OK);
    assert_eq!(global_state().unwrap().key(), (16, 1, 8));
    // A handle taken before the reset is still valid and unchanged.
    assert_eq!(size(got, "dp"), 8);
    fsdpturbo_topology_free(got);
    fsdpturbo_topology_free(other);
}
