//! The parallel state: a topology with its meshes, as a value (`ParallelState`, for handles and
//! embedders that run several) and as the process-global singleton the seed keeps
//! (`_FSDPTURBO_PARALLEL_STATE`).
//!
//! The global is set once; initialising again with the same topology is a no-op that returns
//! the same `Arc`, with a different one an error (the seed's text). `reset_global_state` starts
//! over. All of it is thread-safe. The process-wide model-spec and operator registries live here
//! too.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use std::sync::LazyLock;

use crate::error::{Error, ErrorKind, Result};
use crate::pattern::PatternSet;
use crate::registry::{ImplId, OpRegistry, Registered, Resolved};
use crate::spec::{ModelSpec, SpecRegistry};
use crate::topology::{Mesh, Topology};

/// A resolved topology with its meshes built once.
#[derive(Debug)]
pub struct ParallelState {
    topology: Topology,
    data_mesh: Mesh,
    model_mesh: Mesh,
    expert_mesh: Option<Mesh>,
}

impl ParallelState {
    pub fn new(topology: Topology) -> ParallelState {
        ParallelState {
            data_mesh: topology.data_mesh(),
            model_mesh: topology.model_mesh(),
            expert_mesh: topology.expert_mesh(),
            topology,
        }
    }

    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// `(dp, cp)`, dims `("dp", "cp")`.
    pub fn data_mesh(&self) -> &Mesh {
        &self.data_mesh
    }

    /// `(mp_replicate, mp_shard)`, dims `("mp_replicate", "mp_shard")`.
    pub fn model_mesh(&self) -> &Mesh {
        &self.model_mesh
    }

    /// `(edp, efsdp, ep, expert_cp)`; `None` when `ep_size == 1`.
    pub fn expert_mesh(&self) -> Option<&Mesh> {
        self.expert_mesh.as_ref()
    }

    /// `(dp, cp, ep)`.
    pub fn key(&self) -> (u64, u64, u64) {
        self.topology.key()
    }
}

static GLOBAL: Mutex<Option<Arc<ParallelState>>> = Mutex::new(None);

/// The fields in which `current` and `requested` differ, as "name (current, got requested)".
fn differing_fields(current: &Topology, requested: &Topology) -> Vec<String> {
    let fields = [
        ("world_size", current.world_size, requested.world_size),
        ("dp_size", current.dp_size, requested.dp_size),
        ("cp_size", current.cp_size, requested.cp_size),
        ("mp_replicate_size", current.mp_replicate_size, requested.mp_replicate_size),
        ("mp_shard_size", current.mp_shard_size, requested.mp_shard_size),
        ("ep_size", current.ep_size, requested.ep_size),
        ("efsdp_size", current.efsdp_size, requested.efsdp_size),
        ("edp_size", current.edp_size, requested.edp_size),
    ];
    fields.iter().filter(|(_, a, b)| a != b).map(|(name, a, b)| format!("{name} ({a}, got {b})")).collect()
}

fn tuple((dp, cp, ep): (u64, u64, u64)) -> String {
    format!("({dp}, {cp}, {ep})")
}

/// Initialises the process-global state. The first call stores `topology`; a later call with an
/// equal topology returns the stored `Arc` and changes nothing; a different topology is an
/// `ErrorKind::State` error that starts with the seed's text
/// `FSDPTurbo parallel state is already initialized with (dp, cp, ep), got (dp, cp, ep).` and
/// names every field that differs (also those outside `(dp, cp, ep)`). A hand-built topology
/// that `Topology::new` would not produce is rejected (`ErrorKind::Topology`) before any of this.
pub fn initialize_global(topology: Topology) -> Result<Arc<ParallelState>> {
    topology.validate()?;
    let mut slot = GLOBAL.lock();
    match slot.as_ref() {
        Some(current) if *current.topology() == topology => Ok(Arc::clone(current)),
        Some(current) => {
            let differs = differing_fields(current.topology(), &topology);
            Err(Error::new(
                ErrorKind::State,
                format!(
                    "FSDPTurbo parallel state is already initialized with {}, got {}. \
                     The topologies differ in {}. Reset the state first (reset_global_state, \
                     C: fsdpturbo_state_reset) to initialize it with another topology.",
                    tuple(current.key()),
                    tuple(topology.key()),
                    differs.join(", ")
                ),
            ))
        }
        None => {
            let state = Arc::new(ParallelState::new(topology));
            *slot = Some(Arc::clone(&state));
            Ok(state)
        }
    }
}

/// The process-global state, if initialised.
pub fn global_state() -> Option<Arc<ParallelState>> {
    GLOBAL.lock().clone()
}

/// Forgets the process-global state, so the next `initialize_global` may use any topology.
/// `Arc`s handed out earlier stay valid.
pub fn reset_global_state() {
    *GLOBAL.lock() = None;
}

/// The process-wide model-spec registry (built-ins plus specs registered from C or Python).
static SPECS: LazyLock<RwLock<SpecRegistry>> = LazyLock::new(|| RwLock::new(SpecRegistry::with_builtins()));

/// Registers (or replaces) a spec in the process-wide registry after compiling its patterns,
/// so a bad pattern is reported at registration and nothing is stored.
pub fn register_spec(spec: ModelSpec) -> Result<()> {
    if spec.model_type.is_empty() {
        return Err(Error::invalid("model_type must not be empty"));
    }
    if spec.ep_modules.is_empty() {
        return Err(Error::invalid(format!(
            "the spec of {} needs at least one ep_modules pattern",
            spec.model_type
        )));
    }
    PatternSet::compile(&spec.ep_modules)?;
    PatternSet::compile(&spec.efsdp_modules())?;
    SPECS.write().register(spec);
    Ok(())
}

/// The spec of `model_type` from the process-wide registry.
pub fn spec(model_type: &str) -> Result<ModelSpec> {
    SPECS.read().get(model_type).cloned()
}

/// The process-wide operator registry (operators registered from C, C++ or Python).
static OPS: LazyLock<Mutex<OpRegistry>> = LazyLock::new(|| Mutex::new(OpRegistry::new()));

/// Registers an implementation in the process-wide operator registry (see `OpRegistry::register`).
pub fn register_op(op_name: &str, device_type: &str) -> Result<Registered> {
    OPS.lock().register(op_name, device_type)
}

/// Resolves an operator in the process-wide registry (see `OpRegistry::resolve`).
pub fn resolve_op(op_name: &str, device_type: &str) -> Result<Resolved> {
    OPS.lock().resolve(op_name, device_type)
}

/// A copy of the process-wide operator table: name → device type → implementation id.
pub fn op_table() -> BTreeMap<String, BTreeMap<String, ImplId>> {
    OPS.lock().table().clone()
}
