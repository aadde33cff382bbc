"""Training checkpoints (`fsdpturbo.save_checkpoint` / `load_checkpoint`, on torch's own DCP):
a run trained at one layout, saved mid-way, resumed at another layout (ep, efsdp / edp,
Shard(0)/Shard(1), ep = 1, another world size) from a model built with other random weights,
equals the uninterrupted run: losses and every parameter after the last step. Also: a crash
mid-save leaves the previous checkpoint loadable, and a checkpoint of another model or a
truncated file fails with an error naming the tensor."""
import os

import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks
from models import SEQ, build_model, full, train_config

GLOBAL_BATCH = 4
STEPS, SAVE_AT = 4, 2
LR = 1e-3
# Resuming at the saving layout replays the same arithmetic: bitwise. At another layout the
# reductions run in another order: per element |resumed - uninterrupted| <= ATOL + RTOL |uninterrupted|.
ATOL, RTOL = 1e-6, 1e-6


def _batch(step):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=g)


def _sharded(family, layout, world, seed):
    import fsdpturbo
    from fsdpturbo.engine import shard_model

    ep, efsdp = layout["ep"], layout.get("efsdp")
    state = fsdpturbo.ParallelState(world, ep_size=ep, efsdp_size=efsdp).init_device_meshes("cpu")
    model = shard_model(build_model(family, seed=seed), train_config(ep, efsdp, dispatcher=layout.get("dispatcher",
                                                                                                          "eager")),
                        state=state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, steps, rank, world):
    from fsdpturbo import clip_grad_norm_

    per_rank = GLOBAL_BATCH // world
    losses = []
    for step in steps:
        ids = _batch(step)[rank * per_rank:(rank + 1) * per_rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        clip_grad_norm_(model, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean / world).item())
    return losses


def _params(model):
    return {n: full(p).clone() for n, p in model.named_parameters()}


def _case(directory, family, save):
    name = "-".join(f"{k}{v}" for k, v in sorted(save.items()))
    return os.path.join(directory, f"{family}-{name}")


def _save_rank_fn(rank, world, directory, cases):
    """For each (family, layout): trains STEPS steps, saving at SAVE_AT; rank 0 records the
    uninterrupted run's losses and final parameters."""
    from fsdpturbo import save_checkpoint

    for family, layout in cases:
        where = _case(directory, family, layout)
        model, optimizer, scheduler = _sharded(family, layout, world, seed=0)
        losses = _train(model, optimizer, scheduler, range(SAVE_AT), rank, world)
        save_checkpoint(model, optimizer, where, extra={"scheduler": scheduler, "step": SAVE_AT, "data": "row 8"})
        at_save = _params(model)
        losses += _train(model, optimizer, scheduler, range(SAVE_AT, STEPS), rank, world)
        params = _params(model)
        if rank == 0:
            torch.save({"losses": losses, "params": params, "at_save": at_save}, where + ".reference.pt")
        dist.barrier()


def _resume_rank_fn(rank, world, directory, cases):
    """For each (family, saved layout, layout now): a model with other random weights loads the
    checkpoint, trains the remaining steps and must equal the uninterrupted run."""
    from fsdpturbo import load_checkpoint

    for family, saved, layout in cases:
        where = _case(directory, family, saved)
        what = f"{family} saved at {saved} on 4 ranks, resumed at {layout} on {world}"
        model, optimizer, scheduler = _sharded(family, layout, world, seed=7)
        extra = load_checkpoint(model, optimizer, where, extra={"scheduler": scheduler})
        assert extra["step"] == SAVE_AT and extra["data"] == "row 8", f"{what}: extra {extra}"
        assert scheduler.last_epoch == SAVE_AT, f"{what}: scheduler at {scheduler.last_epoch}"
        losses = _train(model, optimizer, scheduler, range(SAVE_AT, STEPS), rank, world)
        reference = torch.load(where + ".reference.pt")
        exact = saved == layout and world == 4
        expected = reference["losses"][SAVE_AT:]
        for step, (got, want) in enumerate(zip(losses, expected), SAVE_AT):
            assert (got == want) if exact else abs(got - want) <= ATOL + RTOL * abs(want), \
                f"{what}: loss at step {step} {got!r} != uninterrupted {want!r}"
        for name, param in model.named_parameters():
            got, want = full(param), reference["params"][name]
            if exact:
                assert torch.equal(got, want), f"{what}: {name} differs from the uninterrupted run"
            else:
                err = ((got - want).abs() - RTOL * want.abs()).max().item()
                assert err <= ATOL, f"{what}: {name} off by {err:.3e} beyond {RTOL} × |uninterrupted| (> {ATOL})"


SAVED = [("qwen3_moe", dict(ep=2, efsdp=2)), ("qwen3_moe", dict(ep=4)), ("qwen3_moe", dict(ep=1)),
         ("qwen3_5_moe", dict(ep=2, efsdp=1)), ("qwen3_5_moe", dict(ep=1))]
RESUMED_ON_4 = [("qwen3_moe", dict(ep=2, efsdp=2), dict(ep=2, efsdp=2)),   # same layout: bitwise
                ("qwen3_moe", dict(ep=2, efsdp=2), dict(ep=4)),            # Shard(1) on efsdp -> ep only
                ("qwen3_moe", dict(ep=4), dict(ep=1)),                     # EP -> plain FSDP2
                ("qwen3_moe", dict(ep=1), dict(ep=2, efsdp=1, dispatcher="fused")),  # -> edp 2
                ("qwen3_5_moe", dict(ep=2, efsdp=1), dict(ep=2, efsdp=2)),
                ("qwen3_5_moe", dict(ep=1), dict(ep=4))]
RESUMED_ON_2 = [("qwen3_moe", dict(ep=2, efsdp=2), dict(ep=2)),
                ("qwen3_5_moe", dict(ep=2, efsdp=1), dict(ep=1))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("checkpoints"))
    run_ranks(_save_rank_fn, 4, directory, SAVED, timeout=400)
    return directory


def test_resume_at_another_layout_equals_the_uninterrupted_run(saved):
    run_ranks(_resume_rank_fn, 4, saved, RESUMED_ON_4, timeout=400)


def test_resume_at_another_world_size(saved):
    run_ranks(_resume_rank_fn, 2, saved, RESUMED_ON_2, timeout=300)


def _crash_rank_fn(rank, world, directory):
    """A save that fails on one rank part-way leaves the previous checkpoint in place and
    loadable; an asynchronous save completes by `wait()`."""
    import fsdpturbo.checkpoint as checkpoint

    where = os.path.join(directory, "ckpt")
    model, optimizer, scheduler = _sharded("qwen3_moe", dict(ep=2), world, seed=0)
    _train(model, optimizer, scheduler, range(1), rank, world)
    checkpoint.save_checkpoint(model, optimizer, where, extra={"step": 1})
    first = _params(model)
    _train(model, optimizer, scheduler, range(1, 2), rank, world)

    resolve = checkpoint._SavePlanner.resolve_data
    written = []

    def crash(self, write_item):
        written.append(write_item)
        if rank == 1 and len(written) == 3:
            raise OSError("disk full (injected)")
        return resolve(self, write_item)

    checkpoint._SavePlanner.resolve_data = crash
    try:
        with pytest.raises(checkpoint.CheckpointError, match=r"saving the checkpoint .* failed \(rank 1: OSError: disk full"):
            checkpoint.save_checkpoint(model, optimizer, where, extra={"step": 2})
    finally:
        checkpoint._SavePlanner.resolve_data = resolve
    dist.barrier()
    assert sorted(os.listdir(directory)) == ["ckpt"], "the failed save left its staging directory"
    fresh, fresh_optimizer, _ = _sharded("qwen3_moe", dict(ep=2), world, seed=7)
    assert checkpoint.load_checkpoint(fresh, fresh_optimizer, where)["step"] == 1
    for name, value in _params(fresh).items():
        assert torch.equal(value, first[name]), f"{name}: not the previous checkpoint's value after a failed save"

    pending = checkpoint.save_checkpoint(model, optimizer, where, extra={"step": 2}, async_save=True)
    pending.wait()
    assert sorted(os.listdir(directory)) == ["ckpt"]
    assert checkpoint.load_checkpoint(fresh, fresh_optimizer, where)["step"] == 2
    for name, value in _params(fresh).items():
        assert torch.equal(value, _params(model)[name]), f"{name}: the asynchronous save differs"


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path):
    run_ranks(_crash_rank_fn, 2, str(tmp_path), timeout=200)


def _single_process_checkpoint(tmp_path, family="qwen3_moe"):
    from fsdpturbo import save_checkpoint

    model = build_model(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = _batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    where = str(tmp_path / "ckpt")
    save_checkpoint(model, optimizer, where, extra={"step": 1})
    return model, where


def test_a_checkpoint_of_another_model_names_the_tensor(tmp_path):
    from fsdpturbo import load_checkpoint

    _, where = _single_process_checkpoint(tmp_path)
    other = build_model("qwen3_5_moe")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight: the checkpoint has shape "
                                         r"\[16, 16\], the model \[32, 16\]"):
        load_checkpoint(other, None, where)
    with pytest.raises(ValueError, match="saved without an optimizer|missing from the checkpoint"):
        load_checkpoint(other, torch.optim.AdamW(other.parameters()), where)


def test_a_truncated_checkpoint_names_the_file_and_tensor(tmp_path):
    from fsdpturbo import load_checkpoint

    model, where = _single_process_checkpoint(tmp_path)
    data = os.path.join(where, "model", "__0_0.distcp")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    with pytest.raises(ValueError, match=r"__0_0\.distcp' has \d+ bytes, but its tensor '[\w.]+' ends at byte \d+"):
        load_checkpoint(model, None, where)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} was modified by a load that failed"


def test_a_missing_checkpoint_is_a_clear_error(tmp_path):
    from fsdpturbo import load_checkpoint, save_checkpoint

    model = build_model("qwen3_moe")
    with pytest.raises(FileNotFoundError, match="does not exist; expected a directory written by"):
        load_checkpoint(model, None, tmp_path / "nothing")
    save_checkpoint(model, None, tmp_path / "weights-only")
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="saved without an optimizer; pass optimizer=None"):
        load_checkpoint(model, optimizer, tmp_path / "weights-only")
    assert not optimizer.state, "a refused load left the fresh optimizer with moments and a step"
    os.rename(tmp_path / "weights-only", tmp_path / "weights-only.old")  # as if a save died between its renames
    load_checkpoint(model, None, tmp_path / "weights-only")


def _dcp_path_rank_fn(rank, world, directory, cases):
    """`dist_config.dcp_path`: `shard_model` on a model built on meta takes its initial weights
    from a checkpoint saved at another layout, equal bitwise to `load_checkpoint` into a model
    sharded the same way."""
    import fsdpturbo
    from fsdpturbo import load_checkpoint
    from fsdpturbo.engine import shard_model

    for family, saved, layout in cases:
        where = _case(directory, family, saved)
        loaded, _, _ = _sharded(family, layout, world, seed=7)
        load_checkpoint(loaded, None, where)
        config = train_config(layout["ep"], layout.get("efsdp"))
        config["dist_config"]["dcp_path"] = where
        state = fsdpturbo.ParallelState(world, ep_size=layout["ep"],
                                        efsdp_size=layout.get("efsdp")).init_device_meshes("cpu")
        with fsdpturbo.meta_parameters():
            model = build_model(family)
        model = shard_model(model, config, state=state)
        expected = _params(loaded)
        for name, value in _params(model).items():
            assert torch.equal(value, expected[name]), f"{family} {saved} -> {layout}: {name} differs"


def test_dcp_path_gives_the_initial_weights(saved):
    run_ranks(_dcp_path_rank_fn, 4, saved, [("qwen3_moe", dict(ep=2, efsdp=2), dict(ep=4)),
                                            ("qwen3_5_moe", dict(ep=1), dict(ep=2, efsdp=2))], timeout=300)


@pytest.mark.parametrize("family,layout", [("qwen3_moe", dict(ep=2, efsdp=2)), ("qwen3_5_moe", dict(ep=2, efsdp=1))])
def test_offline_conversion_of_a_training_checkpoint_loads_in_transformers(saved, tmp_path, family, layout):
    """`fsdpturbo.convert.dcp_to_hf` (no process group) turns the checkpoint saved on 4 ranks
    into a directory transformers' own `from_pretrained` loads, equal bitwise to the sharded
    model's parameters when it was saved."""
    from transformers import AutoModelForCausalLM

    from fsdpturbo import convert

    where = _case(saved, family, layout)
    build_model(family).config.save_pretrained(tmp_path / "config")
    convert.dcp_to_hf(where, str(tmp_path / "hf"), config=str(tmp_path / "config"))
    loaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").named_parameters())
    expected = torch.load(where + ".reference.pt")["at_save"]
    assert loaded.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), f"{name} differs after the conversion"
