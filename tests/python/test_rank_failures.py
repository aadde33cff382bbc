"""Every rank fails together, fast, with the cause: a step of `save_checkpoint`,
`load_checkpoint` or `shard_model` that fails on some ranks only (an `extra` that cannot be
serialised, a failed write or rename, a truncated or missing copy of a checkpoint, a
configuration that does not parse, a failed read of the weights) makes every rank raise the same error naming the failing
rank and the cause within seconds, not after the process-group timeout; ranks given different
checkpoints or configurations raise an error naming the first difference and both values.
The failing rank catches its error and stays up, as a caller that handles errors would."""
import contextlib
import os
import shutil
import time

import pytest
import torch.distributed as dist

from dist_util import run_ranks
from models import build_model, train_config

FAST_S = 20.0  # far below the harness's process-group timeout (60 s): a rank left waiting would exceed it


def _same_error_everywhere(call, error, pattern):
    """`call()` raises `error` matching `pattern` on this rank, fast; every rank's text is equal.
    Returns the error."""
    start = time.monotonic()
    with pytest.raises(error, match=pattern) as raised:
        call()
    elapsed = time.monotonic() - start
    assert elapsed < FAST_S, f"raised after {elapsed:.1f} s: a rank waited for the others' timeout"
    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, str(raised.value))
    assert len(set(texts)) == 1, f"the ranks raised different errors: {texts}"
    return raised.value


@contextlib.contextmanager
def _failing(module, name, fails, error):
    """`module.name` raises `error` where `fails`, and works as before elsewhere."""
    original = getattr(module, name)

    def replacement(*args, **kwargs):
        if fails:
            raise error
        return original(*args, **kwargs)

    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def _save_rank_fn(rank, world, directory):
    import fsdpturbo.checkpoint as checkpoint
    from fsdpturbo.checkpoint import CheckpointError

    model = build_model("qwen3_moe")
    where = os.path.join(directory, "ckpt")
    checkpoint.save_checkpoint(model, None, where, extra={"step": 1})

    # Rank 0 cannot serialise `extra` (a local function): every rank hears why.
    _same_error_everywhere(lambda: checkpoint.save_checkpoint(model, None, where, extra={"f": lambda: 0}),
                           CheckpointError, r"saving the checkpoint .* failed \(rank 0: \w+Error: .*local")

    # Rank 1's own file cannot be written; then rank 0's rename fails.
    for name, failing_rank, cause in (("write_synced", 1, "disk full"), ("replace", 0, "rename failed")):
        with _failing(checkpoint, name, rank == failing_rank, OSError(f"{cause} (injected)")):
            _same_error_everywhere(lambda: checkpoint.save_checkpoint(model, None, where, extra={"step": 2}),
                                   CheckpointError, rf"failed \(rank {failing_rank}: OSError: {cause} \(injected\)\)")

    dist.barrier()
    assert sorted(os.listdir(directory)) == ["ckpt"], "a failed save left its staging directory"
    assert checkpoint.load_checkpoint(model, None, where)["step"] == 1


def test_a_save_that_fails_on_one_rank_fails_on_every_rank(tmp_path):
    run_ranks(_save_rank_fn, 2, str(tmp_path), timeout=150)


def _load_rank_fn(rank, world, directory):
    from fsdpturbo.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    model = build_model("qwen3_moe")
    first, second = os.path.join(directory, "first"), os.path.join(directory, "second")
    save_checkpoint(model, None, first, extra={"step": 1})
    save_checkpoint(model, None, second, extra={"step": 2})
    if rank == 0:
        shutil.copytree(first, os.path.join(directory, "truncated"))
        data = os.path.join(directory, "truncated", "model", "__0_0.distcp")
        os.truncate(data, os.path.getsize(data) // 2)
    dist.barrier()

    # Rank 1 was handed a truncated copy.
    copy = first if rank == 0 else os.path.join(directory, "truncated")
    error = _same_error_everywhere(lambda: load_checkpoint(model, None, copy), CheckpointError,
                                   r"failed \(rank 1: ValueError: .*__0_0\.distcp' has \d+ bytes, .*truncated")
    assert isinstance(error, ValueError), "what one process raises is caught the same way"
    # Rank 1's checkpoint does not exist.
    missing = first if rank == 0 else os.path.join(directory, "nowhere")
    error = _same_error_everywhere(lambda: load_checkpoint(model, None, missing), CheckpointError,
                                   r"failed \(rank 1: FileNotFoundError: .*nowhere' does not exist")
    assert isinstance(error, FileNotFoundError)
    # The ranks were handed two different complete checkpoints.
    other = first if rank == 0 else second
    _same_error_everywhere(lambda: load_checkpoint(model, None, other), ValueError,
                           r"the ranks disagree on the checkpoint read .* first at \['model/\.metadata'\]: rank 0 has "
                           r"'[0-9a-f]{64}', rank 1 has '[0-9a-f]{64}'")
    assert load_checkpoint(model, None, second)["step"] == 2  # and the ranks still agree on the same one


def test_a_load_that_fails_on_one_rank_fails_on_every_rank(tmp_path):
    run_ranks(_load_rank_fn, 2, str(tmp_path), timeout=150)


def _shard_rank_fn(rank, world, directory):
    import fsdpturbo
    from fsdpturbo.engine import shard_model

    def shard(config, **kwargs):
        with fsdpturbo.meta_parameters():
            model = build_model("qwen3_moe")
        return shard_model(model, config, state=state, **kwargs)

    state = fsdpturbo.ParallelState(world, ep_size=2).init_device_meshes("cpu")
    good = train_config(2)
    # Rank 1's configuration does not parse.
    _same_error_everywhere(lambda: shard(good if rank == 0 else "dist_config: [unclosed\n", weights=directory),
                           ValueError, r"shard_model: reading the training configuration and checkpoints failed "
                                       r"\(rank 1: FSDPTurboValueError: ")
    # Each rank reads the same path, node-local, holding the weights of another run.
    os.chdir(os.path.join(directory, f"host{rank}"))
    _same_error_everywhere(lambda: shard(good, weights="model"), ValueError,
                           r"the ranks disagree on the weights checkpoint: rank\(s\) \[1\] differ from rank 0, first at "
                           r"files\['model\.safetensors'\]\['sample sha256'\]: rank 0 has '[0-9a-f]{64}', rank 1 has "
                           r"'[0-9a-f]{64}'")
    # Equal copies at different paths are one checkpoint.
    shard(good, weights=os.path.join(directory, f"copy{rank}"))
    # The ranks name different training checkpoints.
    config = train_config(2)
    config["dist_config"]["dcp_path"] = os.path.join(directory, f"dcp{rank}")
    _same_error_everywhere(lambda: shard(config), ValueError,
                           r"disagree on the training configuration: rank\(s\) \[1\] differ from rank 0, first at "
                           r"dist\.dcp_path: rank 0 has '.*dcp0', rank 1 has '.*dcp1'")
    # Rank 1's read of its slices fails (a disk error after the checkpoints were compared).
    import fsdpturbo.engine as engine
    with _failing(engine, "load_hf_weights", rank == 1, OSError("Input/output error (injected)")):
        _same_error_everywhere(lambda: shard(good, weights=directory), OSError,
                               r"loading the weights '.*' failed \(rank 1: OSError: Input/output error \(injected\)\)")
    model = shard(good, weights=directory)  # and the same inputs still work
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_shard_model_inputs_that_fail_or_differ_on_one_rank_fail_on_every_rank(tmp_path):
    from fsdpturbo.convert import hf_to_dcp

    build_model("qwen3_moe").save_pretrained(tmp_path)
    for rank in range(2):
        build_model("qwen3_moe", seed=rank).save_pretrained(tmp_path / f"host{rank}" / "model")
        shutil.copytree(tmp_path, tmp_path / f"copy{rank}", ignore=shutil.ignore_patterns("host*", "copy*", "dcp*"))
        hf_to_dcp(str(tmp_path), str(tmp_path / f"dcp{rank}"), check=False)
    run_ranks(_shard_rank_fn, 2, str(tmp_path), timeout=200)


def test_the_weights_fingerprint_tells_files_of_one_layout_apart(tmp_path):
    """Two checkpoints of one architecture have equal headers; the sampled data tells them apart."""
    from fsdpturbo.weights import checkpoint_fingerprint

    for seed in range(2):
        build_model("qwen3_moe", seed=seed).save_pretrained(tmp_path / f"seed{seed}")
    a, b = (checkpoint_fingerprint(tmp_path / f"seed{seed}") for seed in range(2))
    assert a["files"].keys() == b["files"].keys()
    name = next(iter(a["files"]))
    assert a["files"][name]["header sha256"] == b["files"][name]["header sha256"]
    assert a["files"][name]["sample sha256"] != b["files"][name]["sample sha256"]


def test_the_disagreement_names_the_first_differing_key_and_both_values():
    from fsdpturbo.consistency import _first_difference

    mine = {"dist": {"name": "fsdpturbo", "ep_size": 2, "hook_modules": ["a", "b"]}, "bf16": False}
    theirs = {"dist": {"name": "fsdpturbo", "ep_size": 1, "hook_modules": ["a", "b"]}, "bf16": False}
    assert _first_difference(mine, theirs) == ("dist.ep_size", "2", "1")
    theirs = {"dist": {"name": "fsdpturbo", "ep_size": 2, "hook_modules": ["a", "c\n"]}, "bf16": False}
    assert _first_difference(mine, theirs) == ("dist.hook_modules[1]", "'b'", "'c\\n'")
    assert _first_difference({"x.y": 1}, {"x.y": 1, "z": 2}) == ("z", "<absent>", "2")
