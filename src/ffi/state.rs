//! C ABI of `state`: the process-global parallel state.

use super::error::FfiError;
use super::handle::{arg_ref, into_handle, write_out};
use super::panic::boundary;
use super::status::FSDPTURBO_ERR_STATE;
use super::topology::fsdpturbo_topology_t;
use crate::state;

/// Initialises the process-global parallel state with a copy of `topology`. Calling it again
/// with an equal topology is a no-op; with a different one it fails with FSDPTURBO_ERR_STATE and
/// the message "FSDPTurbo parallel state is already initialized with (dp, cp, ep), got
/// (dp, cp, ep)." followed by the fields that differ. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_state_initialize(topology: *const fsdpturbo_topology_t) -> i32 {
    boundary(|| {
        let topology = arg_ref(topology, "topology")?.topology.clone();
        state::initialize_global(topology)?;
        Ok(())
    })
}

/// Stores in `*out` a new topology handle holding a copy of the global state's topology (free
/// it with fsdpturbo_topology_free). FSDPTURBO_ERR_STATE, with `*out` set to NULL, when the
/// state is not initialised.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_state_get(out: *mut *mut fsdpturbo_topology_t) -> i32 {
    boundary(|| {
        write_out(out, "out", std::ptr::null_mut())?;
        let state = state::global_state().ok_or_else(|| {
            FfiError::new(
                FSDPTURBO_ERR_STATE,
                "the FSDPTurbo parallel state is not initialized; call fsdpturbo_state_initialize first",
            )
        })?;
        let handle = into_handle(fsdpturbo_topology_t::from_topology(state.topology().clone()));
        write_out(out, "out", handle)
    })
}

/// Forgets the process-global parallel state, so it can be initialised with another topology.
/// Handles obtained earlier stay valid. Leaves the thread's last error untouched.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_state_reset() {
    let _ = std::panic::catch_unwind(state::reset_global_state);
}
