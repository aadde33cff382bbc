"""The CUDA backends that work without a GPU, in CI: NVRTC compiles every kernel to PTX for
sm_80 and sm_90 (NVRTC ships in the pip wheels), NCCL loads through the run-time loader and
makes unique ids, a missing library is a clear error, and the host-callback collective (a gloo
process group lent to Rust) runs the C-ABI grad norm and all-to-all-v against torch's own
`clip_grad_norm_` and `all_to_all_single`.
"""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import fsdpturbo
from fsdpturbo._native import FSDPTurboError, wheel_library_dirs
from dist_util import run_ranks
import native_comm


def _have(name):
    return any(os.path.exists(os.path.join(d, name)) for d in wheel_library_dirs())


needs_nvrtc = pytest.mark.skipif(not (_have("libnvrtc.so.13") or _have("libnvrtc.so.12")),
                                 reason="no NVRTC wheel in this environment")
needs_nccl = pytest.mark.skipif(not _have("libnccl.so.2"), reason="no NCCL wheel in this environment")


@needs_nvrtc
@pytest.mark.parametrize("arch", [80, 90])
def test_every_kernel_compiles_to_ptx(arch, tmp_path, monkeypatch):
    import ctypes
    monkeypatch.setenv("FSDPTURBO_KERNEL_CACHE", str(tmp_path))
    sources, size = ctypes.c_size_t(), ctypes.c_size_t()
    fsdpturbo._native.check(native_comm.lib.fsdpturbo_cuda_compile_kernels(arch, False, ctypes.byref(sources),
                                                                           ctypes.byref(size)))
    assert sources.value == 3 and size.value > 10_000
    major, minor = ctypes.c_int32(), ctypes.c_int32()
    fsdpturbo._native.check(native_comm.lib.fsdpturbo_nvrtc_version(ctypes.byref(major), ctypes.byref(minor)))
    assert major.value >= 12


@needs_nvrtc
def test_bad_arch_is_a_clear_error():
    import ctypes
    n = ctypes.c_size_t()
    with pytest.raises(ValueError, match="compute capability"):
        fsdpturbo._native.check(native_comm.lib.fsdpturbo_cuda_compile_kernels(7, False, ctypes.byref(n),
                                                                               ctypes.byref(n)))


@needs_nccl
def test_nccl_loads_reports_its_version_and_makes_unique_ids():
    code, text = native_comm.nccl_version()
    assert code >= 20700 and text.startswith("2.")
    a, b = native_comm.nccl_unique_id(), native_comm.nccl_unique_id()
    assert len(a) == native_comm.UNIQUE_ID_BYTES and any(a) and a != b


def test_a_missing_library_lists_what_was_tried():
    # A fresh process: the loader caches its first answer. It finds native_comm on this process's path.
    code = ("import native_comm as c\n"
            "try:\n    c.nccl_version()\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    env = dict(os.environ, FSDPTURBO_NCCL_PATH="/nonexistent/libnccl.so.2", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    assert "FSDPTurboError NCCL is not available on this host; tried: FSDPTURBO_NCCL_PATH=/nonexistent/libnccl.so.2" \
        in out, out


def test_a_gpu_only_call_fails_cleanly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(FSDPTurboError, match="UNAVAILABLE|not available|CUDA driver"):
        native_comm.nccl_comm(b"\0" * native_comm.UNIQUE_ID_BYTES, 1, 0, 0)


def test_single_rank_comm_copies():
    c = native_comm.single_rank_comm()
    t = torch.arange(5, dtype=torch.float32)
    c.all_reduce(t)
    assert t.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"`dtype` is 42, not an FSDPTURBO_DTYPE_\* value"):
        fsdpturbo._native.check(native_comm.lib.fsdpturbo_comm_all_reduce(c.handle, t.data_ptr(), t.data_ptr(), 5,
                                                                          42, 0, None))


# ---------------------------------------------------------------------------------------------
# Host callbacks on gloo ranks.

def _grad_norm_rank(rank, world, p):
    torch.manual_seed(0)
    # The same full gradients everywhere; rank r holds row block r of the sharded ones.
    full = [torch.randn(8, 5), torch.randn(6, 3, dtype=torch.float64), torch.randn(4), torch.randn(3, 2)]
    sharded = [0, 1]
    grads, layouts = [], []
    for i, f in enumerate(full):
        if i in sharded:
            grads.append(f.chunk(world)[rank].clone().contiguous())
            layouts.append([(7, 0)])  # Shard on mesh dim 7 (any id names the group)
        else:
            grads.append(f.clone())
            layouts.append([(7, 1)] if i == 2 else [])  # Replicate, or a plain tensor
    ref = [f.clone().requires_grad_() for f in full]
    for r, f in zip(ref, full):
        r.grad = f.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm=0.5, norm_type=p)
    host = native_comm.host_comm()
    total = native_comm.clip_grad_norm_host(grads, layouts, {(7,): host}, max_norm=0.5, norm_type=p)
    assert math.isclose(total, float(want), rel_tol=1e-6), (total, float(want))
    for i, (g, r) in enumerate(zip(grads, ref)):
        expect = r.grad.chunk(world)[rank] if i in sharded else r.grad
        torch.testing.assert_close(g, expect.to(g.dtype), rtol=1e-5, atol=1e-7)
    # A set without a communicator fails on every rank, before any gradient is touched.
    before = [g.clone() for g in grads]
    with pytest.raises(ValueError, match=r"no entry of `groups` has the mesh dims \[7\]"):
        native_comm.clip_grad_norm_host(grads, layouts, {(3,): host}, max_norm=0.5, norm_type=p)
    for g, b in zip(grads, before):
        assert torch.equal(g, b)


@pytest.mark.parametrize("p", [2.0, math.inf])
def test_host_callback_grad_norm_matches_torch_clip_grad_norm(p):
    run_ranks(_grad_norm_rank, 2, p, timeout=120)


def _all_to_all_rank(rank, world):
    # Rank r sends (r + p) % 3 rows to rank p: some pairs send nothing.
    send_counts = [(rank + p) % 3 for p in range(world)]
    recv_counts = [(p + rank) % 3 for p in range(world)]
    send = torch.randn(sum(send_counts), 4, generator=torch.Generator().manual_seed(rank))
    recv = torch.full((sum(recv_counts), 4), float("nan"))
    native_comm.host_comm().all_to_all_v(send, recv, send_counts, recv_counts)
    want = torch.empty_like(recv)
    dist.all_to_all_single(want, send, recv_counts, send_counts)
    assert torch.equal(recv, want)


def test_host_callback_all_to_all_v_matches_all_to_all_single():
    run_ranks(_all_to_all_rank, 3, timeout=120)
