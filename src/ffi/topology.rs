//! C ABI of `topology`: build a topology from sizes or from a parsed training configuration,
//! read its sizes, mesh shapes, rank coordinates and communication groups.

use std::ffi::c_char;

use super::config::fsdpturbo_config_t;
use super::error::FfiError;
use super::handle::{
    arg_ref, arg_str, check_struct_size, free_handle, into_handle, invalid, struct_size_of, write_out,
    write_slice,
};
use super::panic::boundary;
use crate::error::Escaped;
use crate::plan::topology_spec;
use crate::topology::{Mesh, Topology, TopologySpec};

/// Selects the data mesh `(dp, cp)`, dims "dp", "cp".
pub const FSDPTURBO_MESH_DATA: i32 = 0;
/// Selects the model mesh `(mp_replicate, mp_shard)`, dims "mp_replicate", "mp_shard".
pub const FSDPTURBO_MESH_MODEL: i32 = 1;
/// Selects the expert mesh `(edp, efsdp, ep, expert_cp)`, dims "edp", "efsdp", "ep",
/// "expert_cp". It exists only when ep_size > 1.
pub const FSDPTURBO_MESH_EXPERT: i32 = 2;

/// The sizes of a topology. Initialise with FSDPTURBO_TOPOLOGY_OPTIONS_INIT, then set the
/// sizes you need. A 0 in dp_size, mp_shard_size or efsdp_size means "the default formula";
/// every other size must be at least 1.
#[repr(C)]
pub struct fsdpturbo_topology_options_t {
    /// sizeof(fsdpturbo_topology_options_t), as set by FSDPTURBO_TOPOLOGY_OPTIONS_INIT.
    pub struct_size: usize,
    /// Number of ranks; 1 means "not distributed". Default 1.
    pub world_size: u64,
    /// Data-parallel size; 0 (default) means world_size / cp_size.
    pub dp_size: u64,
    /// Context-parallel size. Default 1.
    pub cp_size: u64,
    /// Replicate dim of the model mesh. Default 1.
    pub mp_replicate_size: u64,
    /// Shard dim of the model mesh; 0 (default) means world_size / mp_replicate_size.
    pub mp_shard_size: u64,
    /// Expert-parallel size; 1 (default) means no expert parallelism and no expert mesh.
    pub ep_size: u64,
    /// Expert-FSDP size, only with ep_size > 1; 0 (default) means dp_size / ep_size (edp 1).
    /// A divisor of dp_size / ep_size gives edp = dp_size / (ep_size * efsdp_size) replicas.
    pub efsdp_size: u64,
}

/// The size of the first published version of `fsdpturbo_topology_options_t`: the end of its
/// last field, `efsdp_size`. Fields added later go after it and leave this unchanged.
const TOPOLOGY_OPTIONS_V1_SIZE: usize =
    std::mem::offset_of!(fsdpturbo_topology_options_t, efsdp_size) + std::mem::size_of::<u64>();

/// An opaque, immutable topology. Made by fsdpturbo_topology_new,
/// fsdpturbo_topology_from_config or fsdpturbo_state_get; freed with fsdpturbo_topology_free.
pub struct fsdpturbo_topology_t {
    pub(crate) topology: Topology,
}

impl fsdpturbo_topology_t {
    pub(crate) fn from_topology(topology: Topology) -> Self {
        fsdpturbo_topology_t { topology }
    }
}

fn default_if_zero(value: u64) -> Option<u64> {
    (value != 0).then_some(value)
}

/// The dims accepted by fsdpturbo_topology_size.
const SIZE_NAMES: &str = "world, dp, cp, mp_replicate, mp_shard, ep, efsdp, edp, expert_cp";

fn size_of_dim(topology: &Topology, dim: &str) -> Result<u64, FfiError> {
    Ok(match dim {
        "world" => topology.world_size,
        "dp" => topology.dp_size,
        "cp" => topology.cp_size,
        "mp_replicate" => topology.mp_replicate_size,
        "mp_shard" => topology.mp_shard_size,
        "ep" => topology.ep_size,
        "efsdp" => topology.efsdp_size,
        "edp" => topology.edp_size,
        "expert_cp" => topology.cp_size,
        _ => {
            return Err(invalid(format!(
                "argument `dim` is \"{}\", which is not a topology size; accepted: {SIZE_NAMES}",
                Escaped(dim)
            )));
        }
    })
}

/// Mesh `mesh` (FSDPTURBO_MESH_*) of the `topology` handle argument.
fn select_mesh(topology: *const fsdpturbo_topology_t, mesh: i32) -> Result<Mesh, FfiError> {
    let topology = &arg_ref(topology, "topology")?.topology;
    match mesh {
        FSDPTURBO_MESH_DATA => Ok(topology.data_mesh()),
        FSDPTURBO_MESH_MODEL => Ok(topology.model_mesh()),
        FSDPTURBO_MESH_EXPERT => topology.expert_mesh().ok_or_else(|| {
            invalid(
                "argument `mesh` is FSDPTURBO_MESH_EXPERT (2), but this topology has no expert mesh: \
                 ep_size is 1. Build the topology with ep_size > 1 to get one."
                    .into(),
            )
        }),
        _ => Err(invalid(format!(
            "argument `mesh` is {mesh}; accepted: FSDPTURBO_MESH_DATA (0), FSDPTURBO_MESH_MODEL (1), \
                 FSDPTURBO_MESH_EXPERT (2)"
        ))),
    }
}

/// Splits "efsdp,ep" into dim names; blanks around names are ignored, empty names rejected.
fn parse_dims(dims: &str) -> Result<Vec<&str>, FfiError> {
    let names: Vec<&str> = dims.split(',').map(str::trim).collect();
    if names.iter().any(|n| n.is_empty()) {
        return Err(invalid(format!(
            "argument `dims` is \"{}\"; it must be one or more mesh dim names separated by commas, \
                 e.g. \"ep\" or \"efsdp,ep\", with no empty names",
            Escaped(dims)
        )));
    }
    Ok(names)
}

/// Builds a topology from `options` and stores a new handle in `*out` (NULL on failure).
/// Errors: FSDPTURBO_ERR_NULL_ARGUMENT, FSDPTURBO_ERR_STRUCT_SIZE (options not initialised with
/// FSDPTURBO_TOPOLOGY_OPTIONS_INIT), FSDPTURBO_ERR_TOPOLOGY (inconsistent sizes; the message
/// names them and what is accepted).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_topology_new(
    options: *const fsdpturbo_topology_options_t,
    out: *mut *mut fsdpturbo_topology_t,
) -> i32 {
    boundary(|| {
        let struct_size = struct_size_of(options, "options")?;
        write_out(out, "out", std::ptr::null_mut())?;
        check_struct_size(
            struct_size,
            TOPOLOGY_OPTIONS_V1_SIZE,
            "options",
            "fsdpturbo_topology_options_t",
            Some("FSDPTURBO_TOPOLOGY_OPTIONS_INIT"),
        )?;
        let options = arg_ref(options, "options")?;
        let spec = TopologySpec {
            world_size: options.world_size,
            dp_size: default_if_zero(options.dp_size),
            cp_size: options.cp_size,
            mp_replicate_size: options.mp_replicate_size,
            mp_shard_size: default_if_zero(options.mp_shard_size),
            ep_size: options.ep_size,
            efsdp_size: default_if_zero(options.efsdp_size),
        };
        let topology = Topology::new(&spec)?;
        write_out(out, "out", into_handle(fsdpturbo_topology_t::from_topology(topology)))
    })
}

/// Builds the topology that `config` asks for on `world_size` ranks and stores a new handle in
/// `*out` (NULL on failure): its dp_size, cp_size, mp_replicate_size, mp_shard_size and
/// dist_config's ep_size and efsdp_size, each one the YAML leaves unset taking its default
/// formula, as with fsdpturbo_topology_new. Errors: FSDPTURBO_ERR_NULL_ARGUMENT,
/// FSDPTURBO_ERR_TOPOLOGY (sizes that do not fit `world_size`; the message names them and
/// what is accepted).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_topology_from_config(
    config: *const fsdpturbo_config_t,
    world_size: u64,
    out: *mut *mut fsdpturbo_topology_t,
) -> i32 {
    boundary(|| {
        write_out(out, "out", std::ptr::null_mut())?;
        let config = arg_ref(config, "config")?.config();
        let topology = Topology::new(&topology_spec(config, world_size))?;
        write_out(out, "out", into_handle(fsdpturbo_topology_t::from_topology(topology)))
    })
}

/// Frees a topology handle; NULL is a no-op. Leaves the thread's last error untouched, so it
/// can be called while cleaning up after a failure.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_topology_free(topology: *mut fsdpturbo_topology_t) {
    let _ = std::panic::catch_unwind(|| free_handle(topology));
}

/// Stores one size of the topology in `*out`. `dim` is one of: "world", "dp", "cp",
/// "mp_replicate", "mp_shard", "ep", "efsdp", "edp", "expert_cp" (always equal to cp). With
/// ep_size 1, efsdp and edp are 1. An unknown name gives FSDPTURBO_ERR_INVALID_ARGUMENT.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_topology_size(
    topology: *const fsdpturbo_topology_t,
    dim: *const c_char,
    out: *mut u64,
) -> i32 {
    boundary(|| {
        let topology = &arg_ref(topology, "topology")?.topology;
        let dim = arg_str(dim, "dim")?;
        write_out(out, "out", size_of_dim(topology, dim)?)
    })
}

/// Copies the shape of mesh `mesh` (FSDPTURBO_MESH_*) into `shape` (capacity `capacity`
/// elements) and stores its number of dims in `*out_len`. A short buffer (NULL with capacity 0
/// asks for the length) gives FSDPTURBO_ERR_BUFFER_TOO_SMALL with `*out_len` set.
/// FSDPTURBO_MESH_EXPERT with ep_size 1 gives FSDPTURBO_ERR_INVALID_ARGUMENT.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_topology_mesh_shape(
    topology: *const fsdpturbo_topology_t,
    mesh: i32,
    shape: *mut u64,
    capacity: usize,
    out_len: *mut usize,
) -> i32 {
    boundary(|| {
        let mesh = select_mesh(topology, mesh)?;
        write_slice(shape, capacity, out_len, &mesh.shape, "shape")
    })
}

/// Copies the coordinate of `rank` in mesh `mesh` (row-major, last dim fastest, as torch
/// init_device_mesh) into `coordinate` and its length into `*out_len`. A rank outside the mesh
/// gives FSDPTURBO_ERR_INVALID_ARGUMENT; a short buffer FSDPTURBO_ERR_BUFFER_TOO_SMALL.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_topology_coordinate(
    topology: *const fsdpturbo_topology_t,
    mesh: i32,
    rank: u64,
    coordinate: *mut u64,
    capacity: usize,
    out_len: *mut usize,
) -> i32 {
    boundary(|| {
        let mesh = select_mesh(topology, mesh)?;
        let coord = mesh.coordinate(rank)?;
        write_slice(coordinate, capacity, out_len, &coord, "coordinate")
    })
}

/// Copies the members of `rank`'s group over `dims` in mesh `mesh` into `members` and their
/// count into `*out_len`. `dims` is a comma-separated list of the mesh's dim names, e.g. "ep" or
/// "efsdp,ep". With one dim, member i has group-local rank i; with several, the order is
/// row-major over the dims as listed (the first slowest), like torch `mesh["efsdp", "ep"]`.
/// Unknown or repeated dims and ranks outside the mesh give FSDPTURBO_ERR_INVALID_ARGUMENT; a
/// short buffer FSDPTURBO_ERR_BUFFER_TOO_SMALL with `*out_len` set to the group size.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_topology_group(
    topology: *const fsdpturbo_topology_t,
    mesh: i32,
    dims: *const c_char,
    rank: u64,
    members: *mut u64,
    capacity: usize,
    out_len: *mut usize,
) -> i32 {
    boundary(|| {
        let mesh = select_mesh(topology, mesh)?;
        let dims = parse_dims(arg_str(dims, "dims")?)?;
        let group = mesh.group(rank, &dims)?;
        write_slice(members, capacity, out_len, &group, "members")
    })
}
