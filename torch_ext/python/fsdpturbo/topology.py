"""The parallel topology: sizes, meshes and groups from the Rust core, and the torch
DeviceMeshes built from them with the seed's exact shapes and dim names."""
import ctypes

from . import _native
from ._native import check, lib, u64_out
from .config import config_handle

_MESHES = {"data": _native.MESH_DATA, "model": _native.MESH_MODEL, "expert": _native.MESH_EXPERT}
_DIM_NAMES = {"data": ("dp", "cp"), "model": ("mp_replicate", "mp_shard"),
              "expert": ("edp", "efsdp", "ep", "expert_cp")}


class ParallelState:
    """A topology (base meshes (dp, cp) and (mp_replicate, mp_shard); with ep > 1 the expert
    mesh (edp, efsdp, ep, expert_cp)) and, after `init_device_meshes`, its torch meshes."""

    def __init__(self, world_size, *, dp_size=None, cp_size=1, mp_replicate_size=1, mp_shard_size=None,
                 ep_size=1, efsdp_size=None):
        options = _native.TopologyOptions(
            ctypes.sizeof(_native.TopologyOptions), world_size, dp_size or 0, cp_size, mp_replicate_size,
            mp_shard_size or 0, ep_size, efsdp_size or 0)
        self._adopt(lib.fsdpturbo_topology_new, ctypes.byref(options))

    @classmethod
    def from_config(cls, config, world_size):
        """The topology a training config (a `TrainConfig`, or a path, YAML text or dict) asks for
        on `world_size` ranks, built by the Rust core from the parsed configuration."""
        state = cls.__new__(cls)
        with config_handle(config) as handle:
            state._adopt(lib.fsdpturbo_topology_from_config, handle, world_size)
        return state

    def _adopt(self, make, *args):
        """Takes the topology handle `make(*args, &handle)` builds; no torch meshes yet."""
        handle = ctypes.c_void_p()
        check(make(*args, ctypes.byref(handle)))
        self._handle = handle
        self.data_mesh = self.model_mesh = self.expert_mesh = None

    def __del__(self):
        if getattr(self, "_handle", None):
            lib.fsdpturbo_topology_free(self._handle)

    def size(self, dim):
        """The size of `dim`: world, dp, cp, mp_replicate, mp_shard, ep, efsdp, edp or expert_cp."""
        out = ctypes.c_uint64(0)
        check(lib.fsdpturbo_topology_size(self._handle, dim.encode(), ctypes.byref(out)))
        return out.value

    world_size = property(lambda self: self.size("world"))
    dp_size = property(lambda self: self.size("dp"))
    cp_size = property(lambda self: self.size("cp"))
    ep_size = property(lambda self: self.size("ep"))
    efsdp_size = property(lambda self: self.size("efsdp"))
    edp_size = property(lambda self: self.size("edp"))

    def key(self):
        """(dp, cp, ep): what the seed compares on re-initialisation."""
        return (self.dp_size, self.cp_size, self.ep_size)

    def mesh_shape(self, mesh):
        """The shape of the "data", "model" or "expert" mesh (expert: only with ep > 1)."""
        return tuple(u64_out(lib.fsdpturbo_topology_mesh_shape, self._handle, _MESHES[mesh], capacity=4))

    def coordinate(self, mesh, rank):
        return tuple(u64_out(lib.fsdpturbo_topology_coordinate, self._handle, _MESHES[mesh], rank, capacity=4))

    def group_ranks(self, mesh, dims, rank):
        """The global ranks of `rank`'s group over `dims` (a name or a sequence of names)."""
        dims = dims if isinstance(dims, str) else ",".join(dims)
        return u64_out(lib.fsdpturbo_topology_group, self._handle, _MESHES[mesh], dims.encode(), rank)

    def init_device_meshes(self, device_type="cpu"):
        """Creates the torch meshes exactly as the seed does (LlamaFactory's model and data meshes,
        then FSDPTurbo's expert mesh with keyword arguments) and checks every group of this rank
        against the Rust topology. Needs an initialised process group; returns self."""
        from torch.distributed.device_mesh import init_device_mesh
        import torch.distributed as dist

        self.model_mesh = init_device_mesh(device_type, self.mesh_shape("model"), mesh_dim_names=_DIM_NAMES["model"])
        self.data_mesh = init_device_mesh(device_type, self.mesh_shape("data"), mesh_dim_names=_DIM_NAMES["data"])
        if self.ep_size > 1:
            self.expert_mesh = init_device_mesh(device_type=device_type, mesh_shape=self.mesh_shape("expert"),
                                                mesh_dim_names=_DIM_NAMES["expert"])
        rank = dist.get_rank()
        for name, mesh in (("model", self.model_mesh), ("data", self.data_mesh), ("expert", self.expert_mesh)):
            if mesh is None:
                continue
            for dim in _DIM_NAMES[name]:
                ours = self.group_ranks(name, dim, rank)
                theirs = dist.get_process_group_ranks(mesh[dim].get_group())
                if ours != theirs:
                    raise RuntimeError(f"fsdpturbo: torch's {name} mesh group over {dim} of rank {rank} is "
                                       f"{theirs}, the topology says {ours}")
        return self

    def sub_mesh(self, dim):
        """The 1-D torch mesh of `dim` (dp, cp, mp_replicate, mp_shard, edp, efsdp, ep, expert_cp),
        or None when that mesh does not exist (no EP, or meshes not created)."""
        for name, mesh in (("data", self.data_mesh), ("model", self.model_mesh), ("expert", self.expert_mesh)):
            if dim in _DIM_NAMES[name]:
                return None if mesh is None else mesh[dim]
        raise ValueError(f"unknown mesh dim {dim!r}; accepted: "
                         f"{', '.join(d for names in _DIM_NAMES.values() for d in names)}")


_GLOBAL = None


def initialize_parallel_state(state: ParallelState) -> ParallelState:
    """Makes `state` the process-global parallel state. Initialising again with the same topology
    returns the first state unchanged; a different one raises the seed's RuntimeError."""
    global _GLOBAL
    check(lib.fsdpturbo_state_initialize(state._handle))
    if _GLOBAL is None:
        _GLOBAL = state
    return _GLOBAL


def get_parallel_state():
    """The process-global parallel state, or None before `initialize_parallel_state`."""
    return _GLOBAL


def reset_parallel_state():
    global _GLOBAL
    lib.fsdpturbo_state_reset()
    _GLOBAL = None
