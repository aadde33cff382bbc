"""Checkpoints cross between LlamaFactory's own fsdp2 plugin (`save_checkpoint` /
`load_checkpoint` of `llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2`, unmodified)
and ours (`fsdpturbo.llamafactory.save_checkpoint` / `load_checkpoint`), each loaded at another
ep size than it was saved at: every parameter and AdamW moment arrives bitwise.

Run by ctest (`llamafactory_checkpoint_interop`, label `llamafactory`), on 2 gloo ranks.
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from dist_util import run_ranks  # noqa: E402
from models import build_model, full, train_config  # noqa: E402


def _sharded(ep, world, seed):
    import fsdpturbo
    from fsdpturbo.engine import shard_model

    state = fsdpturbo.ParallelState(world, ep_size=ep).init_device_meshes("cpu")
    model = shard_model(build_model("qwen3_moe", seed=seed), train_config(ep), state=state)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _trained(ep, world, rank):
    model, optimizer = _sharded(ep, world, seed=0)
    ids = torch.randint(0, 64, (world, 6), generator=torch.Generator().manual_seed(5))[rank:rank + 1]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


def _snapshot(model, optimizer):
    params = dict(model.named_parameters())
    moments = {f"{name}.{key}": full(optimizer.state[p][key]).clone()
               for name, p in params.items() for key in ("exp_avg", "exp_avg_sq")}
    return {**{n: full(p).clone() for n, p in params.items()}, **moments}


def _assert_same(got, want, what):
    assert got.keys() == want.keys(), f"{what}: other tensors"
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{what}: {name} differs"


def _interop_rank_fn(rank, world, directory):
    from llamafactory.v1.plugins.trainer_plugins.distributed import fsdp2

    import fsdpturbo.llamafactory as ours

    model, optimizer = _trained(2, world, rank)
    expected = _snapshot(model, optimizer)

    fsdp2.save_checkpoint(model, optimizer, os.path.join(directory, "by_llamafactory"))
    loaded, loaded_optimizer = _sharded(1, world, seed=7)
    assert ours.load_checkpoint(loaded, loaded_optimizer, os.path.join(directory, "by_llamafactory")) == {}
    _assert_same(_snapshot(loaded, loaded_optimizer), expected, "LlamaFactory's ep 2 checkpoint loaded by ours at ep 1")

    ours.save_checkpoint(model, optimizer, os.path.join(directory, "by_fsdpturbo"), extra={"step": 1})
    loaded, loaded_optimizer = _sharded(1, world, seed=7)
    fsdp2.load_checkpoint(loaded, loaded_optimizer, os.path.join(directory, "by_fsdpturbo"))
    _assert_same(_snapshot(loaded, loaded_optimizer), expected, "our ep 2 checkpoint loaded by LlamaFactory's at ep 1")


def test_checkpoints_cross_between_llamafactory_and_fsdpturbo(tmp_path):
    run_ranks(_interop_rank_fn, 2, str(tmp_path), timeout=240)
