"""`FSDPTurboParallelState` (the expert mesh on LlamaFactory's base meshes) and the trainer's
`clip_grad_norm_`."""
import logging

from torch.distributed.device_mesh import init_device_mesh

from .. import norm
from ..config import TrainConfig
from ..topology import ParallelState

logger = logging.getLogger(__name__)

# LlamaFactory's `Dim` members are strings; these are their values.
DP, CP = "dp", "cp"


class FSDPTurboParallelState:
    """The seed's parallel state: dp, cp, ep, efsdp and edp sizes and, with ep > 1, the expert
    mesh (edp, efsdp, ep, expert_cp) and its 1-D sub-meshes; `topology`, the Rust topology they
    come from (what the plan resolves against). Making one touches no mesh."""
    EDP, EFSDP, EP, EXPERT_CP = "edp", "efsdp", "ep", "expert_cp"

    def __init__(self):
        self._initialized = False
        self.topology = None
        self.dp_size = self.cp_size = self.ep_size = self.efsdp_size = self.edp_size = 1
        self.expert_mesh = self.edp_mesh = self.efsdp_mesh = self.ep_mesh = self.expert_cp_mesh = None

    @property
    def initialized(self):
        return self._initialized

    def initialize(self, dist_interface, dist_config):
        """The topology of dp (`dist_interface.get_world_size("dp")`), cp
        (`dist_interface.strategy.cp_size`) and `dist_config` (the dict of `FSDPTurboParams`:
        its `ep_size` and our optional `efsdp_size`) on dp · cp ranks, validated and built by the
        Rust core; with ep > 1 creates the expert mesh with `init_device_mesh(device_type=...,
        mesh_shape=(edp, efsdp, ep, cp), mesh_dim_names=("edp", "efsdp", "ep", "expert_cp"))` on
        the dp mesh's device type. Initialising again with the same (dp, cp, ep) does nothing; a
        different one raises the seed's RuntimeError."""
        dp_size = int(dist_interface.get_world_size(DP))
        cp_size = int(dist_interface.strategy.cp_size)
        config = TrainConfig({"dp_size": dp_size, "cp_size": cp_size, "dist_config": dist_config})
        topology = ParallelState.from_config(config, dp_size * cp_size)
        if self._initialized:
            current = (self.dp_size, self.cp_size, self.ep_size)
            if current != topology.key():
                raise RuntimeError(f"FSDPTurbo parallel state is already initialized with {current}, "
                                   f"got {topology.key()}.")
            return self
        self.topology = topology
        self.dp_size, self.cp_size, self.ep_size = topology.key()
        self.efsdp_size, self.edp_size = topology.efsdp_size, topology.edp_size
        if self.ep_size > 1:
            dp_mesh = dist_interface.get_device_mesh(DP)
            if dp_mesh is None:
                raise RuntimeError("FSDPTurbo expert parallelism requires an initialized distributed device mesh.")
            self.expert_mesh = init_device_mesh(device_type=dp_mesh.device_type,
                                                mesh_shape=topology.mesh_shape("expert"),
                                                mesh_dim_names=(self.EDP, self.EFSDP, self.EP, self.EXPERT_CP))
            self.edp_mesh = self.expert_mesh[self.EDP]
            self.efsdp_mesh = self.expert_mesh[self.EFSDP]
            self.ep_mesh = self.expert_mesh[self.EP]
            self.expert_cp_mesh = self.expert_mesh[self.EXPERT_CP]
        self._initialized = True
        return self


_FSDPTURBO_PARALLEL_STATE = FSDPTurboParallelState()


def get_fsdpturbo_parallel_state():
    return _FSDPTURBO_PARALLEL_STATE


def clip_grad_norm_(model, max_norm, **kwargs):
    """The trainer's grad-norm call: fsdpturbo's placement-aware `clip_grad_norm_` over the
    model's gradients on every mesh (`norm_type` from kwargs, default 2), returned as a float.
    The parallel state must be initialised (the seed's error)."""
    if not get_fsdpturbo_parallel_state().initialized:
        raise RuntimeError("FSDPTurbo parallel state must be initialized before clipping gradients.")
    total = norm.clip_grad_norm_(model, max_norm, norm_type=float(kwargs.get("norm_type", 2.0)),
                                 error_if_nonfinite=bool(kwargs.get("error_if_nonfinite", False)))
    return float(total)
