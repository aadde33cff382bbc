"""LlamaFactory's launcher (one rank under torchrun: `cp_fixed_launcher.py <stage> <config>`)
with the three changes its fsdpturbo plugin needs at cp_size > 1 applied to the pinned build,
exactly as docs/llamafactory-cp.md ("What LlamaFactory has to change") states them; the rest of
LlamaFactory runs unmodified. Test-only: test_llamafactory_trainer.py shows with it that these
changes are enough for LlamaFactory's trainer on our package to equal its fsdp2 at cp 2.

1. The outer FSDP2 shards the dense parameters over the whole world (LlamaFactory's fsdp2
   mesh, `model_device_mesh`: mp_replicate 1 × mp_shard world) instead of the dp mesh alone.
2. The expert gradients are divided by ep · efsdp · cp (the plugin states ep · efsdp).
3. The grad norm sums the expert p-th powers over efsdp and ep only, not over expert_cp (where
   the experts are replicas).
"""
import functools
import runpy
import sys

import llamafactory.v1.launcher as launcher
from fsdp_turbo.distributed.expert_parallel import expert_parallel  # the plugin imports it at the call
from llamafactory.v1.plugins.trainer_plugins.distributed import fsdpturbo as plugin


def _shard_dense_over_the_world(init):
    @functools.wraps(init)
    def __init__(self, dist_config, bf16=False):
        init(self, dist_config, bf16=bf16)
        self.fsdp_mesh = self.device_mesh
    return __init__


def _divide_expert_gradients_by_cp_too(expert_parallelize_modules):
    @functools.wraps(expert_parallelize_modules)
    def parallelize(model, ep_mesh, ep_plan, *args, **kwargs):
        ep_plan.gradient_divide_factor *= plugin.get_fsdpturbo_parallel_state().cp_size
        return expert_parallelize_modules(model, ep_mesh, ep_plan, *args, **kwargs)
    return parallelize


def _no_expert_norm_sum_over_expert_cp(initialize):
    @functools.wraps(initialize)
    def initialize_without_expert_cp_in_the_norm(self, *args, **kwargs):
        initialize(self, *args, **kwargs)
        self.expert_cp_mesh = None  # read only by the plugin's clip_grad_norm_
    return initialize_without_expert_cp_in_the_norm


plugin.FSDPTurboFSDP2Engine.__init__ = _shard_dense_over_the_world(plugin.FSDPTurboFSDP2Engine.__init__)
expert_parallel.expert_parallelize_modules = _divide_expert_gradients_by_cp_too(
    expert_parallel.expert_parallelize_modules)
plugin.FSDPTurboParallelState.initialize = _no_expert_norm_sum_over_expert_cp(plugin.FSDPTurboParallelState.initialize)

sys.argv[0] = launcher.__file__
runpy.run_path(launcher.__file__, run_name="__main__")
