"""Benchmark: offline checkpoint conversion, peak memory and time, ours vs the in-memory way.

A synthetic Qwen-MoE-shaped Hugging Face checkpoint (bf16, per-expert layout: `--layers`
layers of `--experts` experts, plus embedding and LM head) is written to a temporary
directory; then, each in a fresh process (so peak RSS is its own), in one run:
  * to-dcp ours  - `fsdpturbo.convert.hf_to_dcp` (lazy DCP planner, one tensor at a time);
  * to-dcp whole - `safetensors.torch.load_file` of every file, experts fused, one `dcp.save`;
  * to-hf ours   - `fsdpturbo.convert.dcp_to_hf` (streamed safetensors writer);
  * to-hf whole  - every DCP tensor read into one dict, split per expert, `save_file`.
Peak memory is the process's peak anonymous RSS (RssAnon, sampled every 2 ms) minus its value
after imports: file pages mapped by safetensors or DCP count in RSS but are reclaimable page
cache, so they are left out. Verification is off for both (ours re-reads the output when verifying, a separate pass). Page cache is warm for all.

Usage: PYTHONPATH=torch_ext/python python benches/convert.py [--layers 4 --experts 64 --hidden 1024]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from fsdpturbo import convert, hf_layout
from fsdpturbo.weights import checkpoint_files

import threading

def anon_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon")) / 1024

peak = [0.0]
running = True
def sample():
    while running:
        peak[0] = max(peak[0], anon_mb())
        time.sleep(0.002)

mode, src, out = sys.argv[1:4]
base = anon_mb()
threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
if mode == "to-dcp ours":
    convert.hf_to_dcp(src, out, check=False)
elif mode == "to-dcp whole":
    tensors = {}
    for f in checkpoint_files(src):
        tensors.update(load_file(f))
    fused = {name: (tensors[rows] if isinstance(rows, str) else hf_layout.stack(rows, tensors.__getitem__))
             for name, rows in hf_layout.fuse(list(tensors)).items()}
    del tensors
    dcp.save(fused, checkpoint_id=os.path.join(out, "model"), no_dist=True)
elif mode == "to-hf ours":
    convert.dcp_to_hf(src, out, check=False)
else:
    source = convert._DcpTensors(src)
    split = {k: v.clone() for name in source.meta for k, v in hf_layout.split(name, source.read(name))}
    os.makedirs(out, exist_ok=True)
    save_file(split, os.path.join(out, "model.safetensors"))
seconds = time.perf_counter() - start
running = False
print(json.dumps({"seconds": seconds, "peak_mb": max(peak[0], anon_mb()) - base}))
"""


def _synthetic(directory, layers, experts, hidden, vocab):
    import torch
    from safetensors.torch import save_file

    inter = hidden // 2
    largest = 0
    for layer in range(layers):
        tensors = {}
        for e in range(experts):
            prefix = f"model.layers.{layer}.mlp.experts.{e}"
            tensors[f"{prefix}.gate_proj.weight"] = torch.randn(inter, hidden).bfloat16()
            tensors[f"{prefix}.up_proj.weight"] = torch.randn(inter, hidden).bfloat16()
            tensors[f"{prefix}.down_proj.weight"] = torch.randn(hidden, inter).bfloat16()
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(experts, hidden).bfloat16()
        save_file(tensors, os.path.join(directory, f"model-{layer:05d}.safetensors"))
        largest = max(largest, experts * 2 * inter * hidden * 2)
    embed = {"model.embed_tokens.weight": torch.randn(vocab, hidden).bfloat16(),
             "lm_head.weight": torch.randn(vocab, hidden).bfloat16()}
    save_file(embed, os.path.join(directory, "model-embed.safetensors"))
    largest = max(largest, vocab * hidden * 2)
    total = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    return total, largest


def _run(mode, src, out):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", CHILD, mode, src, out], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=65536)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf = os.path.join(tmp, "hf")
        os.makedirs(hf)
        total, largest = _synthetic(hf, args.layers, args.experts, args.hidden, args.vocab)
        print(f"checkpoint {total / 2**20:.0f} MB, largest fused tensor {largest / 2**20:.0f} MB")
        results = {}
        for mode in ("to-dcp ours", "to-dcp whole"):
            results[mode] = _run(mode, hf, os.path.join(tmp, mode.replace(" ", "_")))
        dcp_dir = os.path.join(tmp, "to-dcp_ours")
        for mode in ("to-hf ours", "to-hf whole"):
            results[mode] = _run(mode, dcp_dir, os.path.join(tmp, mode.replace(" ", "_")))
    print("| direction | ours: s, peak MB (× largest) | whole: s, peak MB | time ratio | memory ratio |")
    print("|---|---|---|---|---|")
    for direction in ("to-dcp", "to-hf"):
        ours, whole = results[f"{direction} ours"], results[f"{direction} whole"]
        print(f"| {direction} | {ours['seconds']:.1f}, {ours['peak_mb']:.0f} ({ours['peak_mb'] * 2**20 / largest:.2f}×) "
              f"| {whole['seconds']:.1f}, {whole['peak_mb']:.0f} | {whole['seconds'] / ours['seconds']:.2f}× "
              f"| {whole['peak_mb'] / ours['peak_mb']:.1f}× less |")


if __name__ == "__main__":
    main()
