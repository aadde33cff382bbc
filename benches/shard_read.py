"""Benchmark: shard-on-read Hugging Face loading vs the full-read loader it replaces, 4 gloo ranks.

Writes a synthetic MoE checkpoint (default 2.3 GB, bf16, Hugging Face's per-expert layout,
sharded into ~500 MB files with an index) to a temporary folder, builds on every rank a model
of DTensor parameters (experts Shard(0) over the 4 ranks as EP, dense weights and the embedding
Shard(0) as FSDP would, norms Replicate), and loads it with
  * new - `fsdpturbo.load_hf_weights` (each rank `pread`s only its slices' byte ranges);
  * old - `fsdpturbo.weights._full_read_reference` (the loader before: `safe_open` + every full
          tensor on every rank, stacked per expert, sliced by `copy_weights_`).
Each loader runs in a fresh set of rank processes (peak RSS is a process high-water mark).

Per rank it reports: bytes read from the files (`rchar` of /proc/self/io counts every read()
/pread() byte; the old loader reads through safetensors' mmap, which rchar does not see, so its
figure is the bytes of the tensors it materialises, counted here), bytes read from the disk
(`read_bytes`, with the files evicted from the page cache by posix_fadvise(DONTNEED) before
each rank's load; a page already cached by another rank is charged to that one), peak RSS
(ru_maxrss) and its growth over the RSS just before the load, and the load time. With
--mode serial (default) the ranks load one after another, each alone on the machine with a
cold cache (clean per-rank figures on a shared 2-core host); with --mode concurrent all
ranks load at once (page cache warm after the first run).

Targets (issue 13): bytes read per rank <= its local share + 5 %, peak RSS growth <= local share
+ the largest single tensor (the local share in the parameters' dtype: fp32 parameters hold
twice the bytes of a bf16 checkpoint's share).

Usage: PYTHONPATH=torch_ext/python python benches/shard_read.py [--gb 2.3] [--mode serial|concurrent]
       [--param-dtype bf16|fp32] [--dir /tmp/...] [--keep]
"""
import argparse
import gc
import json
import math
import os
import pathlib
import resource
import shutil
import sys
import tempfile
import time

os.environ.setdefault("FT_PG_TIMEOUT_S", "900")  # a rank waits at a barrier while another loads
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))

import torch  # noqa: E402

from dist_util import run_ranks  # noqa: E402

H, I, E, VOCAB = 2048, 768, 16, 32000  # Qwen3-30B-A3B-like widths; layers set the size
WORLD = 4


def _layers_for(gb):
    per_layer = (E * 3 * I * H + 4 * H * H + 2 * H) * 2
    return max(1, round((gb * 1e9 - 2 * VOCAB * H * 2) / per_layer))


def _tensors(layers):
    """(model name, global shape, placement kind) of every parameter, and per-expert stacking."""
    out = [("model.embed_tokens.weight", (VOCAB, H), "shard"), ("lm_head.weight", (VOCAB, H), "shard"),
           ("model.norm.weight", (H,), "replicate")]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        out += [(f"{p}.self_attn.{w}.weight", (H, H), "shard") for w in ("q_proj", "k_proj", "v_proj", "o_proj")]
        out += [(f"{p}.input_layernorm.weight", (H,), "replicate"),
                (f"{p}.post_attention_layernorm.weight", (H,), "replicate"),
                (f"{p}.mlp.experts.gate_up_proj", (E, 2 * I, H), "shard"),
                (f"{p}.mlp.experts.down_proj", (E, H, I), "shard")]
    return out


def write_checkpoint(folder, layers):
    """Per-expert keys (HF's layout), bf16, ~500 MB files and model.safetensors.index.json."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    shard, shard_bytes, files, weight_map = {}, 0, [], {}

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            files.append(name)
            shard, shard_bytes = {}, 0

    def add(key, shape):
        nonlocal shard_bytes
        shard[key] = torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
        shard_bytes += math.prod(shape) * 2
        if shard_bytes > 500e6:
            flush()

    for name, shape, _ in _tensors(layers):
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            for e in range(E):
                add(f"{prefix}.{e}.gate_proj.weight", (I, H))
                add(f"{prefix}.{e}.up_proj.weight", (I, H))
        elif leaf == "down_proj":
            for e in range(E):
                add(f"{prefix}.{e}.down_proj.weight", (H, I))
        else:
            add(name, shape)
    flush()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    for name in files:
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return sum(os.path.getsize(os.path.join(folder, n)) for n in files)


def build_model(layers, dtype):
    """Empty DTensor parameters (storage not yet touched) of every tensor on a 1-D mesh of 4."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (WORLD,))
    model = nn.Module()
    local_share = local_param_bytes = 0
    for name, shape, kind in _tensors(layers):
        placements = [Shard(0) if kind == "shard" else Replicate()]
        local_shape, _ = _compute_local_shape_and_global_offset(shape, mesh.shape, mesh.get_coordinate(), placements)
        stride = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        param = DTensor.from_local(torch.empty(local_shape, dtype=dtype), mesh, placements, shape=torch.Size(shape),
                                   stride=tuple(stride))
        owner = model
        *parts, leaf = name.split(".")
        for part in parts:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, nn.Parameter(param, requires_grad=False))
        local_share += math.prod(local_shape) * 2  # checkpoint (bf16) bytes of this rank's slice
        local_param_bytes += math.prod(local_shape) * param.element_size()
    return model, local_share, local_param_bytes


def _io():
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _evict(folder):
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _rank_fn(rank, world, loader, folder, layers, dtype_name, mode, out):
    import torch.distributed as dist

    from fsdpturbo.weights import _full_read_reference, load_hf_weights

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    model, local_share, local_param_bytes = build_model(layers, dtype)
    checkpoint_bytes = sum(math.prod(s) * 2 for _, s, _ in _tensors(layers))
    gc.collect()
    for turn in range(world if mode == "serial" else 1):
        dist.barrier()
        if mode == "serial" and turn != rank:
            continue
        if mode == "serial":
            _evict(folder)
        io0, rss0 = _io(), _rss_bytes()
        start = time.perf_counter()
        if loader == "new":
            load_hf_weights(model, folder)
        else:
            _full_read_reference(model, folder)
        seconds = time.perf_counter() - start
        gc.collect()
        io1 = _io()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        rchar = io1["rchar"] - io0["rchar"]
        result = {"rank": rank, "loader": loader, "seconds": seconds, "local_share": local_share,
                  "local_param_bytes": local_param_bytes,
                  "file_bytes": rchar if loader == "new" else checkpoint_bytes, "rchar": rchar,
                  "disk_bytes": io1["read_bytes"] - io0["read_bytes"], "peak_rss": peak, "rss_before": rss0,
                  "rss_growth": peak - rss0}
        with open(os.path.join(out, f"{loader}_{rank}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.3, help="checkpoint size (>= 2 for the issue's target)")
    parser.add_argument("--mode", choices=["serial", "concurrent"], default="serial")
    parser.add_argument("--param-dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a new folder in /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (default: deleted at the end)")
    args = parser.parse_args()
    layers = _layers_for(args.gb)
    folder = args.dir or tempfile.mkdtemp(prefix="fsdpturbo_shard_read_")
    os.makedirs(folder, exist_ok=True)
    out = tempfile.mkdtemp(prefix="fsdpturbo_shard_read_results_")
    try:
        t = time.perf_counter()
        size = write_checkpoint(folder, layers) if not os.path.exists(
            os.path.join(folder, "model.safetensors.index.json")) else sum(
            os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".safetensors"))
        largest = max(math.prod(s) * 2 for _, s, _ in _tensors(layers))
        print(f"checkpoint {size / 1e9:.2f} GB ({layers} layers, {E} experts, H={H}, I={I}; largest tensor "
              f"{largest / 1e6:.0f} MB) in {folder}, written in {time.perf_counter() - t:.0f} s; mode {args.mode}, "
              f"params {args.param_dtype}, torch {torch.__version__}")
        for loader in ("old", "new"):
            run_ranks(_rank_fn, WORLD, loader, folder, layers, args.param_dtype, args.mode, out, timeout=3600)
        rows = {(json.load(open(os.path.join(out, n)))["loader"], json.load(open(os.path.join(out, n)))["rank"]):
                json.load(open(os.path.join(out, n))) for n in os.listdir(out)}
        mb = lambda b: f"{b / 1e6:,.0f}"  # noqa: E731
        print(f"{'rank':>4} | {'local share MB':>14} | {'file MB new/old':>17} {'new/share':>9} | "
              f"{'disk MB new/old':>17} | {'RSS growth MB new/old':>21} {'new/(params+largest)':>20} | "
              f"{'load s new/old':>15} {'ratio':>6}")
        for rank in range(WORLD):
            n, o = rows[("new", rank)], rows[("old", rank)]
            share = n["local_share"]
            print(f"{rank:>4} | {mb(share):>14} | {mb(n['file_bytes']):>8}/{mb(o['file_bytes']):>8} "
                  f"{n['file_bytes'] / share:>9.3f} | {mb(n['disk_bytes']):>8}/{mb(o['disk_bytes']):>8} | "
                  f"{mb(n['rss_growth']):>10}/{mb(o['rss_growth']):>10} "
                  f"{n['rss_growth'] / (n['local_param_bytes'] + largest):>20.2f} | "
                  f"{n['seconds']:>7.2f}/{o['seconds']:>7.2f} {n['seconds'] / o['seconds']:>6.2f}")
        print("ratios: file bytes new/old " + ", ".join(
            f"{rows[('new', r)]['file_bytes'] / rows[('old', r)]['file_bytes']:.3f}" for r in range(WORLD)) +
            "; peak RSS new/old " + ", ".join(
            f"{rows[('new', r)]['peak_rss'] / rows[('old', r)]['peak_rss']:.2f}" for r in range(WORLD)))
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
