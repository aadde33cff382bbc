"""Weights: a checkpoint written by Hugging Face's `save_pretrained` of the reference model is
loaded into a sharded model (built on meta, or with other random weights), gathered, saved
back, and reloaded: every tensor bitwise equal, also through FSDP2's own full state dict."""
import os

import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks
from models import build_model, layout_state, train_config

pytestmark = pytest.mark.transformers_5_8  # also run against LlamaFactory's transformers


def _assert_bitwise(actual, expected, what):
    assert sorted(actual) == sorted(expected), f"{what}: names differ: {sorted(set(actual) ^ set(expected))}"
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), f"{what}: {name} differs"


def _safetensors(path):
    from safetensors.torch import load_file

    from fsdpturbo.weights import checkpoint_files

    out = {}
    for f in checkpoint_files(path):
        out.update(load_file(f))
    return out


def _weights_rank_fn(rank, world, family, tmp, layouts):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fsdpturbo.engine import shard_model
    from fsdpturbo.weights import full_state_dict, meta_parameters, save_hf_weights

    reference = build_model(family, seed=0)
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    source = os.path.join(tmp, "reference")
    if rank == 0:
        reference.save_pretrained(source)
    dist.barrier()
    for ep, efsdp in layouts:
        state = layout_state(world, ep, efsdp, 1)
        for init in ("meta", "real"):
            where = f"{family} ep={ep} efsdp={efsdp} init={init}"
            if init == "meta":
                with meta_parameters():
                    model = build_model(family)
                assert all(p.is_meta for p in model.parameters())
                assert not any(b.is_meta for b in model.buffers())
            else:
                model = build_model(family, seed=1)  # other values: the load must overwrite every one
            model = shard_model(model, train_config(ep, efsdp), state=state, weights=source)
            gathered = full_state_dict(model)
            _assert_bitwise(gathered, expected, f"{where} loaded")
            # LlamaFactory saves through FSDP2's full state dict: the same tensors.
            fsdp_full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            _assert_bitwise({n: t for n, t in fsdp_full.items() if n in expected}, expected,
                            f"{where} FSDP2 full state dict")
            target = os.path.join(tmp, f"saved_{ep}_{efsdp}_{init}")
            save_hf_weights(model, target)
            _assert_bitwise(_safetensors(target), _safetensors(source), f"{where} files")
            if rank == 0:
                from transformers import AutoModelForCausalLM

                reloaded = AutoModelForCausalLM.from_pretrained(target)
                _assert_bitwise({n: p.detach() for n, p in reloaded.named_parameters()}, expected, f"{where} HF reload")
            dist.barrier()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_load_save_round_trip_is_bitwise(family, tmp_path):
    run_ranks(_weights_rank_fn, 4, family, str(tmp_path), [(2, None), (4, 1)], timeout=300)


def _missing_rank_fn(rank, world, tmp):
    from safetensors.torch import save_file

    from fsdpturbo.engine import shard_model
    from fsdpturbo.weights import meta_parameters

    path = os.path.join(tmp, "partial.safetensors")
    if rank == 0:
        state = build_model("qwen3_moe").state_dict()
        save_file({n: t for n, t in state.items() if "layers.1.mlp.gate" not in n}, path)
    dist.barrier()
    # One set of meshes for both failures: gloo cannot always make new groups right after a
    # rank raised out of a collective sequence (a torch/gloo limitation, "Broken pipe").
    state = layout_state(world, 2, None, 1)
    with meta_parameters():
        model = build_model("qwen3_moe")
    with pytest.raises(KeyError, match=r"holds no value for the parameters \['model.layers.1.mlp.gate.weight'\]"):
        shard_model(model, train_config(2), state=state, weights=path)
    with meta_parameters():
        model = build_model("qwen3_moe")
    with pytest.raises(ValueError, match="on the meta device and no weights were given"):
        shard_model(model, train_config(2), state=state)


def test_missing_weights_fail_on_every_rank(tmp_path):
    run_ranks(_missing_rank_fn, 2, str(tmp_path), timeout=120)
