"""Loading never runs code from a file: a checkpoint or conversion output whose pickles name
other code (a `__reduce__` that calls a function) is refused with an error naming the file and
the code it names, and the code does not run. Covers `extra.pt`, `rng/rank{r}.pt`, DCP's
`.metadata` and DCP's non-tensor entries (an optimizer's param groups), through
`load_checkpoint`, `load_model_weights` (`dist_config.dcp_path`) and the converter."""
import os
import pickle
import re

import pytest
import torch
from models import build_model



class Payload:
    """Unpickling this calls os.mkdir(marker): the marker exists iff code from the file ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


class Opaque:
    """A class of the caller's: pickled by reference, so loading it would import and call code."""


@pytest.fixture
def checkpoint(tmp_path):
    from fsdpturbo import save_checkpoint

    model = build_model("qwen3_moe")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    where = str(tmp_path / "ckpt")
    save_checkpoint(model, optimizer, where, extra={"step": 1})
    return model, optimizer, where, str(tmp_path / "code-ran")


def _plant_in_metadata(directory, marker):
    """The DCP metadata of `directory`, unchanged but for one planted object."""
    file = os.path.join(directory, ".metadata")
    with open(file, "rb") as f:
        metadata = pickle.load(f)  # the test's own file: trusted here
    metadata.planner_data = Payload(marker)
    with open(file, "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize("file", ["extra.pt", "rng/rank0.pt"])
def test_a_planted_object_in_extra_or_rng_is_refused(checkpoint, file):
    from fsdpturbo import load_checkpoint

    model, optimizer, where, marker = checkpoint
    torch.save({"step": 1, "planted": Payload(marker)}, os.path.join(where, file))
    with pytest.raises(ValueError, match=rf"{file.replace('/', '.')}.* posix\.mkdir"):
        load_checkpoint(model, optimizer, where)
    assert not os.path.exists(marker), f"loading ran code from {file}"


def test_a_planted_object_in_the_dcp_metadata_is_refused(checkpoint):
    from fsdpturbo import load_checkpoint
    from fsdpturbo.checkpoint import load_model_weights

    model, optimizer, where, marker = checkpoint
    _plant_in_metadata(os.path.join(where, "model"), marker)
    for load in (lambda: load_checkpoint(model, optimizer, where), lambda: load_model_weights(model, where)):
        with pytest.raises(ValueError, match=r"model/\.metadata.* posix\.mkdir.* not one of DCP's metadata types"):
            load()
        assert not os.path.exists(marker), "loading ran code from model/.metadata"


def test_a_planted_object_in_a_dcp_byte_entry_is_refused(checkpoint):
    """DCP stores non-tensor values (the optimizer's param groups) as pickles of their own."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from fsdpturbo import load_checkpoint
    from fsdpturbo.checkpoint import CheckpointError

    model, optimizer, where, marker = checkpoint
    state = get_optimizer_state_dict(model, optimizer)
    state["param_groups"][0]["lr"] = Payload(marker)
    directory = os.path.join(where, "optimizer")
    for name in os.listdir(directory):
        os.remove(os.path.join(directory, name))
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    with pytest.raises(CheckpointError, match=r"ValueError: .*'param_groups\.0\.lr' holds posix\.mkdir"):
        load_checkpoint(model, optimizer, where)
    assert not os.path.exists(marker), "loading ran code from a DCP byte entry"


def test_the_converter_refuses_planted_metadata(checkpoint, tmp_path, capsys):
    from fsdpturbo import convert

    _, _, where, marker = checkpoint
    convert.dcp_to_hf(where, str(tmp_path / "hf"))
    convert.hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    _plant_in_metadata(os.path.join(where, "model"), marker)
    _plant_in_metadata(os.path.join(tmp_path, "dcp", "model"), marker)
    capsys.readouterr()
    for command in (["to-hf", where, str(tmp_path / "hf2")], ["verify", str(tmp_path / "dcp")]):
        assert convert.main(command) == 1
        refusal = capsys.readouterr().err
        assert re.search(r"^error: .*model/\.metadata.* posix\.mkdir.* not one of DCP's metadata types", refusal), \
            (command[0], refusal)
    assert not os.path.exists(marker), "the converter ran code from a .metadata"


def test_extra_that_would_need_code_to_load_is_refused_at_save(tmp_path):
    from fsdpturbo import save_checkpoint

    model = build_model("qwen3_moe")
    with pytest.raises(ValueError, match=r"extra.* test_untrusted_files\.Opaque.* plain values"):
        save_checkpoint(model, None, tmp_path / "ckpt", extra={"step": 1, "object": Opaque()})
    assert not os.path.exists(tmp_path / "ckpt")


def test_rng_states_are_stored_as_plain_values_and_restored(checkpoint):
    import random

    import numpy

    from fsdpturbo import load_checkpoint, save_checkpoint

    model, optimizer, where, _ = checkpoint
    save_checkpoint(model, optimizer, where, extra={"step": 1})

    def draw():
        return random.random(), numpy.random.rand(), torch.rand(1).item()

    expected = draw()
    load_checkpoint(model, optimizer, where)
    assert draw() == expected
