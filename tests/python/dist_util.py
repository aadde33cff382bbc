"""Multi-rank test harness: gloo ranks on CPU under a hard deadline.

Ranks start through `forkserver` with torch preloaded (about 3× faster than spawn on two
cores), each with one thread, a loopback rendezvous on a free port, a process-group timeout,
and an overall deadline after which every rank is killed: a hang fails fast instead of
stalling CI. The function run on each rank must be a module-level function of a test module.
"""
import datetime
import os
import socket
import time

import torch.multiprocessing as mp

START_METHOD = os.environ.get("FT_MP_START", "forkserver")
if START_METHOD == "forkserver":
    # transformers' Qwen3-MoE modules too: the EP and training tests build HF blocks on every rank.
    mp.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor",
                               "transformers.models.qwen3_moe.modeling_qwen3_moe",
                               "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "fsdpturbo"])

PG_TIMEOUT_S = float(os.environ.get("FT_PG_TIMEOUT_S", "60"))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world, *args, timeout=180.0):
    """Runs fn(rank, world, *args) on `world` gloo ranks; re-raises the first rank failure."""
    port = _free_port()
    ctx = mp.start_processes(_worker, args=(world, port, fn, args), nprocs=world, join=False,
                             start_method=START_METHOD)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
