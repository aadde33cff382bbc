"""The integration layer LlamaFactory's v1 trainer runs FSDPTurbo through
(`plugins/trainer_plugins/distributed/fsdpturbo.py` of LlamaFactory), backed by fsdpturbo:
the expert-mesh state, the model specs, the mixed-mesh grad norm, the FSDP2 engine and its DCP checkpoints
(`save_checkpoint` / `load_checkpoint`, LlamaFactory's fsdp2 call shapes).

Differences from the seed (docs/seed.md): constructors touch no mesh; `dist_config` is
validated by the Rust core; sizes come from the Rust topology (an optional `efsdp_size` in
`dist_config` gives edp > 1); the plan, the ignored parameters and the divide factor (dp · cp)
come from the Rust plan, through the expert-sharding step `fsdpturbo.shard_model` runs too;
expert gradients are always reduced (also with efsdp = 1) and over expert_cp, router and
shared-expert gradients over ep; the grad norm counts replicas once.
"""
from .engine import FSDP2Engine, FSDPTurboFSDP2Engine, load_checkpoint, save_checkpoint
from ..spec import FSDPTurboEPModelSpec
from .state import FSDPTurboParallelState, clip_grad_norm_, get_fsdpturbo_parallel_state

__all__ = ["FSDP2Engine", "FSDPTurboEPModelSpec", "FSDPTurboFSDP2Engine", "FSDPTurboParallelState",
           "clip_grad_norm_", "get_fsdpturbo_parallel_state", "load_checkpoint", "save_checkpoint"]
