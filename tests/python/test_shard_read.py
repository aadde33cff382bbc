"""Shard-on-read loading: the byte ranges the Rust core plans for a rank's slice, read from a
real safetensors file, equal torch DTensor's own slice (`_compute_local_shape_and_global_offset`
for the shape, torch's shard splitting and `distribute_tensor` for the elements) on random
cases and for the per-expert layout; on 4 gloo ranks the new loader gives bitwise the tensors
of the full-read loader it replaces (bf16 checkpoints into fp32 parameters included); corrupt
and truncated files fail naming the file and the tensor; the progress bar."""
import io
import math
import os
import random

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from dist_util import run_ranks
from fsdpturbo.placement import _triples
from fsdpturbo.progress import Progress
from fsdpturbo.weights import _Checkpoint, load_hf_weights
from models import build_model, layout_state, train_config
from tensor_checks import bits_equal, torch_split_chain

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.uint8, torch.bool,
          torch.float8_e4m3fn]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    return t.contiguous().view(_BITS[t.element_size()]) if t.dtype != torch.bool else t.view(torch.uint8)


def _random_value(shape, dtype, g):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(0, 200, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _random_case(rng):
    """1-3-D tensors (sizes below the mesh size, zeros), 1-3-D meshes, Shard / _StridedShard /
    Replicate on any dim (repeated dims included), a random coordinate."""
    ndim, mesh_ndim = rng.randint(1, 3), rng.randint(1, 3)
    mesh_shape = [rng.choice([1, 2, 3, 4]) for _ in range(mesh_ndim)]
    shape = [rng.choice([0, 1, 2, 3, 5, 7, 8, 12]) for _ in range(ndim)]
    placements = []
    for _ in range(mesh_ndim):
        r, d = rng.random(), rng.randrange(ndim)
        if r < 0.5:
            placements.append(Shard(d))
        elif r < 0.75:
            placements.append(_StridedShard(d, split_factor=rng.randint(1, 3)))
        else:
            placements.append(Replicate())
    return shape, mesh_shape, placements


def _mesh_rank(coordinate, mesh_shape):
    rank = 0
    for c, n in zip(coordinate, mesh_shape):
        rank = rank * n + c
    return rank


def _read_local(checkpoint, sources, global_shape, mesh_shape, coordinate, placements):
    triples = _triples(placements, len(global_shape), "test")
    dtype, shape, reads = checkpoint.plan(sources, tuple(global_shape), tuple(mesh_shape),
                                          _mesh_rank(coordinate, mesh_shape), triples)
    assert sum(r[2] for r in reads) == math.prod(shape) * dtype.itemsize
    return checkpoint.read(reads, torch.empty(shape, dtype=dtype))


def _coordinates(mesh_shape):
    out = [[]]
    for n in mesh_shape:
        out = [c + [i] for c in out for i in range(n)]
    return out


# ------------------------------------------------------------------------------------------
# 1. the plan against torch, one process


def test_read_plan_equals_torch_dtensor_slicing_on_random_cases(tmp_path):
    rng = random.Random(20261201)
    g = torch.Generator().manual_seed(0)
    cases, tensors = [], {}
    for i in range(300):
        shape, mesh_shape, placements = _random_case(rng)
        dtype = DTYPES[i % len(DTYPES)]
        tensors[f"t{i}"] = _random_value(shape, dtype, g)
        cases.append((f"t{i}", shape, mesh_shape, placements))
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    checkpoint = _Checkpoint(path)
    seen = {"strided": 0, "empty shard": 0, "3-D mesh": 0, "repeated dim": 0}
    try:
        for name, shape, mesh_shape, placements in cases:
            for coordinate in _coordinates(mesh_shape):
                local = _read_local(checkpoint, name, shape, mesh_shape, coordinate, placements)
                expected_shape, _ = _compute_local_shape_and_global_offset(shape, mesh_shape, coordinate, placements)
                expected = torch_split_chain(tensors[name], mesh_shape, coordinate, placements)
                assert tuple(local.shape) == tuple(expected_shape) == tuple(expected.shape), (name, coordinate)
                assert bits_equal(local, expected), (name, shape, mesh_shape, coordinate, placements)
                sharded = [p.dim for p in placements if isinstance(p, (Shard, _StridedShard))]
                seen["empty shard"] += any(local.shape[d] == 0 < shape[d] for d in sharded)
            seen["strided"] += any(isinstance(p, _StridedShard) and p.split_factor > 1 for p in placements)
            seen["3-D mesh"] += len(mesh_shape) == 3
            seen["repeated dim"] += len(sharded) != len(set(sharded))
    finally:
        checkpoint.close()
    assert all(v >= 20 for v in seen.values()), seen


def test_per_expert_plan_equals_the_stacked_tensor_slice(tmp_path):
    """The fused gate_up_proj [E, 2I, H] and down_proj [E, H, I] read from per-expert keys spread
    over two files (HF's order), against torch's slice of the stacked tensor."""
    rng = random.Random(5)
    g = torch.Generator().manual_seed(1)
    e_n, inter, hidden = 6, 3, 4
    tensors = {}
    for e in range(e_n):
        tensors[f"m.experts.{e}.gate_proj.weight"] = torch.randn(inter, hidden, generator=g).bfloat16()
        tensors[f"m.experts.{e}.up_proj.weight"] = torch.randn(inter, hidden, generator=g).bfloat16()
        tensors[f"m.experts.{e}.down_proj.weight"] = torch.randn(hidden, inter, generator=g).bfloat16()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[: len(names) // 2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[len(names) // 2:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    checkpoint = _Checkpoint(tmp_path)
    gate_up = torch.stack([torch.cat([tensors[f"m.experts.{e}.gate_proj.weight"],
                                      tensors[f"m.experts.{e}.up_proj.weight"]]) for e in range(e_n)])
    down = torch.stack([tensors[f"m.experts.{e}.down_proj.weight"] for e in range(e_n)])
    try:
        for leaf, full in (("gate_up_proj", gate_up), ("down_proj", down)):
            sources = checkpoint.sources(f"m.experts.{leaf}", e_n)
            assert isinstance(sources, list) and len(sources) == e_n
            for _ in range(40):
                mesh_ndim = rng.randint(1, 3)
                mesh_shape = [rng.choice([1, 2, 3, 4]) for _ in range(mesh_ndim)]
                placements = [rng.choice([Shard(0), Shard(1), Shard(2), _StridedShard(0, split_factor=2),
                                          Replicate()]) for _ in range(mesh_ndim)]
                for coordinate in _coordinates(mesh_shape):
                    local = _read_local(checkpoint, sources, full.shape, mesh_shape, coordinate, placements)
                    expected = torch_split_chain(full, mesh_shape, coordinate, placements)
                    assert bits_equal(local, expected), (leaf, mesh_shape, coordinate, placements)
    finally:
        checkpoint.close()


# ------------------------------------------------------------------------------------------
# 2. bad files


def test_corrupt_and_truncated_files_name_the_file_and_the_tensor(tmp_path):
    from torch import nn

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(4, 4), "b": torch.randn(8, 4)}, str(path))
    data = path.read_bytes()
    model = nn.Module()
    model.a, model.b = nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(8, 4))
    # Truncated on disk: the header is checked against the file's size when it is opened.
    path.write_bytes(data[:-20])
    with pytest.raises(ValueError, match=r"checkpoint file '.*model.safetensors': tensor `b`: its bytes .* run past "
                                         r"the end of the file .*: the file is truncated"):
        load_hf_weights(model, path)
    # Shrinking after the header was read: the read itself names file and tensor.
    path.write_bytes(data)
    checkpoint = _Checkpoint(path)
    try:
        os.truncate(path, len(data) - 20)
        dtype, shape, reads = checkpoint.plan("b", (8, 4))
        with pytest.raises(OSError, match=r"checkpoint file '.*model.safetensors': tensor 'b': the file ends at byte "
                                          r"\d+ but the tensor's bytes run to \d+: the file is truncated"):
            checkpoint.read(reads, torch.empty(shape, dtype=dtype))
    finally:
        checkpoint.close()
    # A corrupt header, an empty file, a shape that does not fit the parameter.
    path.write_bytes(data[:8] + b"[" + data[9:])
    with pytest.raises(ValueError, match=r"checkpoint file '.*model.safetensors': the header is not a valid JSON"):
        load_hf_weights(model, path)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"model.safetensors': .*only 0 bytes were given"):
        load_hf_weights(model, path)
    path.write_bytes(data)
    model.b = nn.Parameter(torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"tensor `b`: its shape is \[8, 4\] but the tensor to load has shape \[4, 8\]"):
        load_hf_weights(model, path)
    model.b = nn.Parameter(torch.zeros(8, 4))
    del model.a
    model.c = nn.Parameter(torch.zeros(1))
    with pytest.raises(KeyError, match=r"holds no value for the parameters \['c'\]"):
        load_hf_weights(model, path)


# ------------------------------------------------------------------------------------------
# 3. the progress bar


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_draws_on_a_terminal_only():
    tty = _Tty()
    with Progress(4e9, "loading", delay=0, interval=0, stream=tty) as bar:
        bar.update(1e9)
        bar.update(3e9)
    text = tty.getvalue()
    assert "loading:  25%" in text and "4.00/4.00 GB" in text and text.endswith("\n"), text
    pipe = io.StringIO()  # not a terminal: quiet
    with Progress(10, "loading", delay=0, stream=pipe) as bar:
        bar.update(10)
    assert pipe.getvalue() == ""
    quick = _Tty()  # a terminal, but done before the delay: quiet
    with Progress(10, "loading", delay=60, stream=quick) as bar:
        bar.update(10)
    assert quick.getvalue() == ""


# ------------------------------------------------------------------------------------------
# 4. four gloo ranks: against distribute_tensor and against the full-read loader


def _distribute_rank_fn(rank, world, tmp):
    """Params placed by distribute_tensor on 1-, 2- and 3-D meshes (uneven, empty, _StridedShard,
    per-expert): the new loader gives exactly distribute_tensor's local tensors, also from a bf16
    checkpoint into fp32 parameters."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    meshes = {1: init_device_mesh("cpu", (4,)), 2: init_device_mesh("cpu", (2, 2)),
              3: init_device_mesh("cpu", (2, 1, 2))}
    g = torch.Generator().manual_seed(3)
    cases = [  # name, global shape, mesh ndim, placements
        ("w.uneven", (10, 3), 1, [Shard(0)]),
        ("w.empty", (3, 5), 1, [Shard(0)]),
        ("w.cols", (4, 7), 2, [Replicate(), Shard(1)]),
        ("w.strided", (8, 6), 2, [_StridedShard(0, split_factor=2), Shard(0)]),
        ("w.nested", (9, 2, 5), 3, [Shard(0), Replicate(), Shard(2)]),
        ("w.replicated", (5,), 1, [Replicate()]),
        ("w.experts.gate_up_proj", (4, 6, 5), 2, [Shard(0), Shard(1)]),
        ("w.experts.down_proj", (4, 5, 3), 2, [Shard(1), Shard(0)]),
    ]
    stored = {}
    fulls = {}
    for name, shape, _, _ in cases:
        full = torch.randn(shape, generator=g).bfloat16()
        fulls[name] = full
        if name.endswith("gate_up_proj"):
            half = shape[1] // 2
            for e in range(shape[0]):
                stored[f"w.experts.{e}.gate_proj.weight"] = full[e, :half].clone()
                stored[f"w.experts.{e}.up_proj.weight"] = full[e, half:].clone()
        elif name.endswith("down_proj"):
            for e in range(shape[0]):
                stored[f"w.experts.{e}.down_proj.weight"] = full[e].clone()
        else:
            stored[name] = full
    path = os.path.join(tmp, "model.safetensors")
    if rank == 0:
        save_file(stored, path)
    dist.barrier()
    for dtype in (torch.bfloat16, torch.float32):
        model = nn.Module()
        expected = {}
        for name, shape, mesh_ndim, placements in cases:
            owner = model
            *path_parts, leaf = name.split(".")
            for part in path_parts:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            full = fulls[name].to(dtype)
            expected[name] = distribute_tensor(full, meshes[mesh_ndim], placements).to_local()
            empty = DTensor.from_local(torch.full(expected[name].shape, 7, dtype=dtype), meshes[mesh_ndim],
                                       placements, shape=full.shape, stride=full.stride())
            owner.register_parameter(leaf, nn.Parameter(empty))
        loaded = load_hf_weights(model, path)
        assert sorted(loaded) == sorted(expected)
        for name, param in model.named_parameters():
            assert bits_equal(param.to_local(), expected[name]), (dtype, name)


def test_loader_equals_distribute_tensor_on_4_ranks(tmp_path):
    run_ranks(_distribute_rank_fn, 4, str(tmp_path), timeout=180)


def _hf_rank_fn(rank, world, family, tmp, layouts):

    from fsdpturbo.engine import shard_model
    from fsdpturbo.weights import _full_read_reference, meta_parameters

    source = os.path.join(tmp, "bf16")
    if rank == 0:
        build_model(family, seed=0).to(torch.bfloat16).save_pretrained(source)  # per-expert keys, bf16
    dist.barrier()
    keys = set()
    from safetensors import safe_open

    for f in os.listdir(source):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(source, f), framework="pt") as h:
                keys.update(h.keys())
    assert any(".experts.0.gate_proj.weight" in k for k in keys), "the checkpoint has the per-expert layout"
    for ep, efsdp in layouts:
        state = layout_state(world, ep, efsdp, 1)
        with meta_parameters():
            new = build_model(family)
        new = shard_model(new, train_config(ep, efsdp), state=state, weights=source)  # shard-on-read
        old = shard_model(build_model(family, seed=1), train_config(ep, efsdp), state=state)
        _full_read_reference(old, source)
        old_params = dict(old.named_parameters())
        placements = set()
        for name, p in new.named_parameters():
            q = old_params[name]
            assert p.dtype == torch.float32
            a = p.to_local() if hasattr(p, "to_local") else p
            b = q.to_local() if hasattr(q, "to_local") else q
            assert bits_equal(a.detach(), b.detach()), f"{family} ep={ep} efsdp={efsdp}: {name} differs"
            placements.add(str(getattr(p, "placements", None)))
        assert any("Shard" in s for s in placements), placements
        dist.barrier()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_shard_on_read_equals_the_full_read_loader_on_4_ranks(family, tmp_path):
    run_ranks(_hf_rank_fn, 4, family, str(tmp_path), [(2, None), (4, 1), (2, 2)], timeout=300)
