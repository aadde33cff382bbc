"""LlamaFactory's v1 launcher with the three changes its fsdpturbo plugin needs at cp_size > 1,
for the build we pin (llamafactory-kt 0.9.6.dev0), whose plugin trains on wrong gradients there
(docs/llamafactory-cp.md). One rank under torchrun, as LlamaFactory's own launcher:

    torchrun --nproc-per-node 8 -m fsdpturbo.llamafactory.launch sft config.yaml

Everything else of LlamaFactory runs unmodified. At cp_size 1 the plugin is left as it is. The
changes, applied only at cp_size > 1:

1. The outer FSDP2 shards the dense parameters over the whole world (LlamaFactory's fsdp2 mesh,
   `model_device_mesh`: mp_replicate 1 x mp_shard world) instead of the dp mesh alone, so their
   gradients are averaged over dp and cp.
2. The expert gradients are divided by ep * efsdp * cp (the plugin states ep * efsdp).
3. The grad norm sums the expert p-th powers over efsdp and ep only, not over expert_cp, where
   the experts are replicas.

Another LlamaFactory build is refused: it may carry LlamaFactory's own fix (its #10936), and
these changes on top of it would be wrong.
"""
import functools
import runpy
import sys
from importlib import metadata

PINNED = "0.9.6.dev0"


class UnsupportedBuild(RuntimeError):
    pass


def _check_build():
    try:
        found = metadata.version("llamafactory-kt")
    except metadata.PackageNotFoundError:
        found = None
    if found != PINNED:
        raise UnsupportedBuild(
            f"fsdpturbo.llamafactory.launch changes the fsdpturbo plugin of llamafactory-kt=={PINNED} and no other "
            f"build; found {'no llamafactory-kt' if found is None else repr(found)}. Run LlamaFactory's own launcher "
            f"(llamafactory-cli) instead; docs/llamafactory-cp.md says what a build must change for cp_size > 1")


def _shard_dense_over_the_world(init):
    @functools.wraps(init)
    def __init__(self, dist_config, bf16=False):
        init(self, dist_config, bf16=bf16)
        if self.parallel_state.cp_size > 1:
            self.fsdp_mesh = self.device_mesh
    return __init__


def _divide_expert_gradients_by_cp_too(expert_parallelize_modules, parallel_state):
    @functools.wraps(expert_parallelize_modules)
    def parallelize(model, ep_mesh, ep_plan, *args, **kwargs):
        ep_plan.gradient_divide_factor *= parallel_state().cp_size
        return expert_parallelize_modules(model, ep_mesh, ep_plan, *args, **kwargs)
    return parallelize


def _no_expert_norm_sum_over_expert_cp(initialize):
    @functools.wraps(initialize)
    def initialize_without_expert_cp_in_the_norm(self, *args, **kwargs):
        initialize(self, *args, **kwargs)
        if self.cp_size > 1:
            self.expert_cp_mesh = None  # read only by the plugin's clip_grad_norm_
    return initialize_without_expert_cp_in_the_norm


def apply():
    """Applies the three changes to the pinned build's plugin; returns LlamaFactory's launcher
    module."""
    _check_build()
    import llamafactory.v1.launcher as launcher
    from llamafactory.v1.plugins.trainer_plugins.distributed import fsdpturbo as plugin

    from fsdp_turbo.distributed.expert_parallel import expert_parallel  # the plugin imports it at the call

    plugin.FSDPTurboFSDP2Engine.__init__ = _shard_dense_over_the_world(plugin.FSDPTurboFSDP2Engine.__init__)
    expert_parallel.expert_parallelize_modules = _divide_expert_gradients_by_cp_too(
        expert_parallel.expert_parallelize_modules, plugin.get_fsdpturbo_parallel_state)
    plugin.FSDPTurboParallelState.initialize = _no_expert_norm_sum_over_expert_cp(
        plugin.FSDPTurboParallelState.initialize)
    return launcher


def main():
    try:
        launcher = apply()
    except UnsupportedBuild as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.argv[0] = launcher.__file__
    runpy.run_path(launcher.__file__, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
