"""Offline conversion (`python -m fsdpturbo.convert`, no process group) between Hugging Face
safetensors and DCP: a round trip HF -> DCP -> HF gives every tensor back bitwise (both Qwen
families, bf16 and fp32, several output files); the DCP it writes loads into the model equal to
transformers' own `from_pretrained`; the verifier catches a changed byte; bad input is named."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open


from fsdpturbo import convert, load_checkpoint
from fsdpturbo.weights import checkpoint_files
from models import build_model


def _tensors(directory):
    handles = [safe_open(f, framework="pt") for f in checkpoint_files(directory)]
    return {key: h.get_tensor(key) for h in handles for key in h.keys()}


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("family,dtype", [("qwen3_moe", torch.bfloat16), ("qwen3_5_moe", torch.float32)])
def test_round_trip_hf_dcp_hf_is_bitwise(tmp_path, family, dtype):
    build_model(family).to(dtype).save_pretrained(tmp_path / "hf")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for args in (["to-dcp", tmp_path / "hf", tmp_path / "dcp"],
                 ["to-hf", tmp_path / "dcp", tmp_path / "back", "--max-shard-size", "16KB"]):
        done = subprocess.run([sys.executable, "-m", "fsdpturbo.convert", *map(str, args)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "verified" in done.stdout, done.stderr
    original, back = _tensors(tmp_path / "hf"), _tensors(tmp_path / "back")
    assert len(checkpoint_files(tmp_path / "back")) > 1
    assert set(back) == set(original)
    for key, value in original.items():
        assert _same_bits(back[key], value), f"{key} changed in the round trip"
    assert os.path.isfile(tmp_path / "back" / "config.json")  # kept by to-dcp, restored by to-hf


def test_the_dcp_it_writes_loads_like_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    build_model("qwen3_moe", seed=3).save_pretrained(tmp_path / "hf")
    convert.hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    model = build_model("qwen3_moe", seed=4)
    load_checkpoint(model, None, tmp_path / "dcp")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_verify_finds_a_changed_byte(tmp_path):
    build_model("qwen3_moe").save_pretrained(tmp_path / "hf")
    convert.hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    convert.dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "back"))
    file = tmp_path / "back" / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x40
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"does not match the manifest"):
        convert.verify(str(tmp_path / "back"))


def _with(**fields):
    return lambda manifest: json.dumps(dict(manifest, **fields))


@pytest.mark.parametrize("rewrite,message", [
    (lambda manifest: "[1, 2]", r"needs a direction \('to-hf' or 'to-dcp'\) and a tensors object"),
    (_with(direction="sideways"), r"needs a direction"),
    (_with(tensors={"w": {"dtype": "__class__", "shape": [2], "sha256": "0"}}),
     r"the entry of 'w' has dtype '__class__'; accepted: \['bfloat16'"),
    (_with(tensors={"w": {"dtype": "float32", "shape": "2", "sha256": "0"}}),
     r"the entry of 'w' has shape '2', not a list of sizes"),
    (_with(tensors={"w": [1]}), r"the entry of 'w' is not \{dtype, shape, sha256\}"),
    (lambda manifest: "{", r"is not a conversion manifest: Expecting property name"),
])
def test_verify_names_what_is_wrong_with_a_manifest(tmp_path, rewrite, message):
    build_model("qwen3_moe").save_pretrained(tmp_path / "hf")
    convert.hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    file = tmp_path / "dcp" / convert.MANIFEST
    file.write_text(rewrite(json.loads(file.read_text())))
    with pytest.raises(ValueError, match=message):
        convert.verify(str(tmp_path / "dcp"))


def test_incomplete_per_expert_weights_are_named(tmp_path):
    from safetensors.torch import save_file

    tensors = {f"model.layers.0.mlp.experts.{e}.{p}.weight": torch.zeros(2, 2)
               for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")}
    del tensors["model.layers.0.mlp.experts.1.up_proj.weight"]
    (tmp_path / "hf").mkdir()
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.1\.up_proj\.weight' is missing"):
        convert.hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    assert convert.main(["to-hf", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 1


def test_a_small_file_naming_a_huge_expert_index_is_refused_at_once(tmp_path):
    """A 128-byte file naming expert 100000000 once made `to-dcp` allocate 3.3 GB and die."""
    import time

    from safetensors.torch import save_file

    (tmp_path / "hf").mkdir()
    save_file({"model.layers.0.mlp.experts.100000000.gate_proj.weight": torch.zeros(1)},
              tmp_path / "hf" / "model.safetensors")
    assert os.path.getsize(tmp_path / "hf" / "model.safetensors") < 200
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj' would have 100000001 experts .* more than the "
                                         r"limit of 65536"):
        convert.hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    assert time.monotonic() - started < 5
    assert not os.path.exists(tmp_path / "dcp")
