"""FSDPTurbo's process-wide parallel state, `fsdp_turbo.distributed.parallel_state`: one per
process (verl builds a reference and an actor engine in one process, each calls
`init_parallel_state`), with the device meshes of the configuration's topology and, per mesh
name, `get_<name>_group`, `get_<name>_group_size`, `get_<name>_rank`,
`get_<name>_device_mesh` and `is_<name>_enable`.

Mesh names: `dp` and `fsdp` (the dense parameters' HSDP dims; `dp_fsdp` both), `data` (the
ranks that take different samples: the whole world while there is no context parallelism),
`ulysses` and `cp` (the context-parallel dim, size 1 until it is built), `ep`, `efsdp`, `edp`
(`edp_efsdp` both; only with expert_parallel_size > 1). A two-dim name's group, size and rank
are lists, one per dim.
"""
import torch
import torch.distributed as dist

from fsdpturbo import topology as engine_topology

from .. import config_check

__all__ = ["ParallelState", "get_parallel_state", "init_parallel_state", "reset_parallel_state"]

# name -> (mesh attribute of the topology, its dims)
_MESHES = {
    "dp": ("model_mesh", ("mp_replicate",)),
    "fsdp": ("model_mesh", ("mp_shard",)),
    "dp_fsdp": ("model_mesh", ("mp_replicate", "mp_shard")),
    "data": ("data_mesh", ("dp",)),
    "ulysses": ("data_mesh", ("cp",)),
    "cp": ("data_mesh", ("cp",)),
    "edp": ("expert_mesh", ("edp",)),
    "efsdp": ("expert_mesh", ("efsdp",)),
    "ep": ("expert_mesh", ("ep",)),
    "edp_efsdp": ("expert_mesh", ("edp", "efsdp")),
}
_QUERIES = {"_group": "group", "_group_size": "size", "_rank": "rank", "_device_mesh": "mesh"}


def _device_type():
    """The meshes' device: the accelerator the default process group's backend drives, CPU
    under gloo."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return "cpu" if accelerator is None or dist.get_backend() == "gloo" else accelerator.type


class ParallelState:
    """The topology of one `FSDPTurboConfig` on this world, with its torch device meshes."""

    def __init__(self, config):
        if not dist.is_initialized():
            dist.init_process_group()
        self.topology = config_check.topology(config, dist.get_world_size()).init_device_meshes(_device_type())
        self.sizes = self._sizes(config)

    @staticmethod
    def _sizes(config):
        d = config.distributed
        return (d.fully_shard_parallel_size, d.tensor_parallel_size, d.ulysses_parallel_size, d.expert_parallel_size,
                d.expert_fully_shard_parallel_size)

    def device_mesh(self, name):
        """The torch mesh of `name` (None for an expert name without expert parallelism)."""
        if name not in _MESHES:
            raise ValueError(f"fsdp_turbo: no mesh named {name!r}; accepted: {', '.join(_MESHES)}")
        attribute, dims = _MESHES[name]
        mesh = getattr(self.topology, attribute)
        return None if mesh is None else mesh[dims if len(dims) > 1 else dims[0]]

    def is_group_enable(self, name):
        """Whether mesh `name` spans more than one rank (in any of its dims); False for a name
        that is no mesh."""
        if name not in _MESHES:
            return False
        mesh = self.device_mesh(name)
        return mesh is not None and mesh.size() > 1

    def _query(self, name, what):
        mesh = self.device_mesh(name)
        if what == "mesh":
            return mesh
        dims = range(len(_MESHES[name][1]))
        if mesh is None:
            if what == "group":
                raise ValueError(f"fsdp_turbo: there is no {name!r} group: expert_parallel_size is 1, so there is "
                                 f"no expert mesh")
            values = [1 if what == "size" else 0 for _ in dims]
        else:
            read = {"group": mesh.get_group, "size": mesh.size, "rank": mesh.get_local_rank}[what]
            values = [read(i) for i in dims]
        return values if len(values) > 1 else values[0]

    def __getattr__(self, attribute):
        for suffix, what in _QUERIES.items():
            name = attribute.removeprefix("get_").removesuffix(suffix)
            if attribute == f"get_{name}{suffix}" and name in _MESHES:
                return lambda: self._query(name, what)
        name = attribute.removeprefix("is_").removesuffix("_enable")
        if attribute == f"is_{name}_enable" and name in _MESHES:
            return lambda: self.is_group_enable(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {attribute!r}; per mesh it has "
                             f"get_<name>_group / _group_size / _rank / _device_mesh and is_<name>_enable, for "
                             f"<name> in {', '.join(_MESHES)}")


_STATE = None


def init_parallel_state(config):
    """The process's parallel state: made from `config` on the first call (initialising the
    default process group if it is not), the same object on every later call. A later
    `config` whose sizes differ raises: one process has one topology."""
    global _STATE
    if _STATE is None:
        _STATE = ParallelState(config)
        engine_topology.initialize_parallel_state(_STATE.topology)
    elif ParallelState._sizes(config) != _STATE.sizes:
        raise RuntimeError(f"fsdp_turbo: the parallel state is already initialised with (fully_shard, tensor, "
                           f"ulysses, expert, expert_fully_shard) parallel sizes {_STATE.sizes}, got "
                           f"{ParallelState._sizes(config)}; call reset_parallel_state() first")
    return _STATE


def get_parallel_state():
    """The state `init_parallel_state` made; RuntimeError before it."""
    if _STATE is None:
        raise RuntimeError("fsdp_turbo: the parallel state is not initialised; call init_parallel_state(config)")
    return _STATE


def reset_parallel_state():
    """Forgets the process's parallel state (after `destroy_process_group`, before a new one)."""
    global _STATE
    _STATE = None
    engine_topology.reset_parallel_state()
