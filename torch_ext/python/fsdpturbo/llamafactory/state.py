"""`FSDPTurboParallelState` (the expert mesh on LlamaFactory's base meshes) and the trainer's
`clip_grad_norm_`."""
import logging

from torch.distributed.device_mesh import init_device_mesh

from .. import norm
from ..topology import ParallelState

logger = logging.getLogger(__name__)

# LlamaFactory's `Dim` members are strings; these are their values.
DP, CP = "dp", "cp"


class FSDPTurboParallelState:
    """The seed's parallel state: dp, cp, ep, efsdp and edp sizes and, with ep > 1, the expert
    mesh (edp, efsdp, ep, expert_cp) and its 1-D sub-meshes. Making one touches no mesh."""
    EDP, EFSDP, EP, EXPERT_CP = "edp", "efsdp", "ep", "expert_cp"

    def __init__(self):
        self._initialized = False
        self.dp_size = self.cp_size = self.ep_size = self.efsdp_size = self.edp_size = 1
        self.expert_mesh = self.edp_mesh = self.efsdp_mesh = self.ep_mesh = self.expert_cp_mesh = None

    @property
    def initialized(self):
        return self._initialized

    def initialize(self, dist_interface, dist_config):
        """Reads dp (`dist_interface.get_world_size("dp")`), cp (`dist_interface.strategy.cp_size`)
        and `ep_size` (and our optional `efsdp_size`) from `dist_config`; with ep > 1 creates the
        expert mesh with `init_device_mesh(device_type=..., mesh_shape=(edp, efsdp, ep, cp),
        mesh_dim_names=("edp", "efsdp", "ep", "expert_cp"))` on the dp mesh's device type. The
        sizes come from the Rust topology. Initialising again with the same (dp, cp, ep) does
        nothing; a different one raises the seed's RuntimeError."""
        dp_size = int(dist_interface.get_world_size(DP))
        cp_size = int(dist_interface.strategy.cp_size)
        ep_size = int(dist_config.get("ep_size", 1))
        if ep_size < 1:
            raise ValueError(f"ep_size must be positive, got {ep_size}.")
        if dp_size % ep_size != 0:
            raise ValueError(f"dp_size must be divisible by ep_size, got {dp_size} % {ep_size} != 0.")
        topology = (dp_size, cp_size, ep_size)
        if self._initialized:
            current = (self.dp_size, self.cp_size, self.ep_size)
            if current != topology:
                raise RuntimeError(f"FSDPTurbo parallel state is already initialized with {current}, got {topology}.")
            return self
        sizes = ParallelState(dp_size * cp_size, dp_size=dp_size, cp_size=cp_size, ep_size=ep_size,
                              efsdp_size=dist_config.get("efsdp_size"))
        self.dp_size, self.cp_size, self.ep_size = topology
        self.efsdp_size, self.edp_size = sizes.efsdp_size, sizes.edp_size
        if ep_size > 1:
            dp_mesh = dist_interface.get_device_mesh(DP)
            if dp_mesh is None:
                raise RuntimeError("FSDPTurbo expert parallelism requires an initialized distributed device mesh.")
            self.expert_mesh = init_device_mesh(device_type=dp_mesh.device_type, mesh_shape=sizes.mesh_shape("expert"),
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
