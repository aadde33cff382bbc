"""Expert-load statistics (`fsdpturbo.expert_load`) on 4 gloo ranks against the routes the same
Hugging Face model takes in one process on the whole global batch: tokens per expert of every
layer, summed over every rank and both micro-batches of a step, under activation checkpointing
(the recomputed forward is not counted again), for every dispatcher; the same on every rank."""
import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks
from models import SEQ, build_model, train_config

MICRO_BATCHES = 2


def _micro_batch(step, world):
    g = torch.Generator().manual_seed(700 + step)
    return torch.randint(0, 64, (world, SEQ), generator=g)


def _reference_counts(family, world):
    """Tokens per expert of each layer over the global batch, from the top-k ids the experts
    module of the one-process model receives."""
    model = build_model(family)
    counts = {}

    def hook(module, args):
        counts[module.name] = counts.get(module.name, 0) + torch.bincount(args[1].reshape(-1),
                                                                          minlength=module.num_experts)

    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.name = name
            module.register_forward_pre_hook(hook)
    with torch.no_grad():
        for step in range(MICRO_BATCHES):
            ids = _micro_batch(step, world)
            for rank in range(world):  # each rank's row alone, as the sharded run sees it
                model(input_ids=ids[rank:rank + 1])
    return counts


def _load_rank_fn(rank, world, family, layouts):
    import fsdpturbo
    from fsdpturbo.engine import shard_model

    expected = _reference_counts(family, world)
    for layout in layouts:
        what = f"{family} {layout}"
        state = fsdpturbo.ParallelState(world, ep_size=layout["ep"], efsdp_size=layout.get("efsdp")) \
            .init_device_meshes("cpu")
        model = shard_model(build_model(family), train_config(layout["ep"], layout.get("efsdp"),
                                                              dispatcher=layout["dispatcher"]), state=state)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        for step in range(MICRO_BATCHES):
            ids = _micro_batch(step, world)[rank:rank + 1]
            model(input_ids=ids, labels=ids).loss.backward()
        loads = fsdpturbo.expert_load(model)
        assert loads.keys() == expected.keys(), f"{what}: modules {sorted(loads)}"
        for name, load in loads.items():
            assert torch.equal(load, expected[name]), f"{what}: {name} counted {load.tolist()}, " \
                                                      f"routed {expected[name].tolist()}"
        gathered = [None] * world
        dist.all_gather_object(gathered, {n: v.tolist() for n, v in loads.items()})
        assert all(g == gathered[0] for g in gathered), f"{what}: ranks disagree"
        assert all(int(v.sum()) == 0 for v in fsdpturbo.expert_load(model).values()), f"{what}: not reset"
        summary = fsdpturbo.expert_load_summary(loads)
        tokens = MICRO_BATCHES * world * SEQ * model.config.num_experts_per_tok
        assert summary["tokens"] == tokens * len(loads), f"{what}: {summary}"
        assert len(fsdpturbo.expert_load_table(loads).splitlines()) == len(loads)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_expert_load_counts_the_global_batch_once(family):
    layouts = [dict(ep=2, efsdp=2, dispatcher="eager"), dict(ep=4, dispatcher="fused"),
               dict(ep=2, efsdp=1, dispatcher="domino")]
    run_ranks(_load_rank_fn, 4, family, layouts, timeout=300)


def test_expert_load_needs_expert_parallel_modules():
    import fsdpturbo

    with pytest.raises(ValueError, match="no expert-parallel module"):
        fsdpturbo.expert_load(build_model("qwen3_moe"))


def test_summary_and_table():
    import fsdpturbo

    loads = {"layers.0.experts": torch.tensor([4, 4, 0, 8]), "layers.1.experts": torch.tensor([2, 2, 2, 2])}
    summary = fsdpturbo.expert_load_summary(loads)
    assert summary["layers.0.experts/max_over_mean"] == 2.0 and summary["layers.1.experts/cv"] == 0.0
    assert summary["idle_experts"] == 1 and summary["tokens"] == 24 and summary["max_over_mean"] == 2.0
    with pytest.warns(DeprecationWarning, match="expert_load_summary"):
        assert fsdpturbo.load_summary(loads) == summary
    table = fsdpturbo.expert_load_table(loads).splitlines()
    assert table[0].endswith("|▒▒ █| max/mean 2.00") and table[1].endswith("|▒▒▒▒| max/mean 1.00"), table
