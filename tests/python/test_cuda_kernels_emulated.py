"""The CPU twin of the CUDA kernel tests: the CUDA C of src/backend/cuda/kernels, compiled for the host by
g++ with a thread-per-CUDA-thread emulation (tests/cuda_emu), launched in the order and shapes
of src/backend/cuda/kernels.rs, must give exactly what the op library's host kernels give: routing
(stable counting sort, zero-token experts, duplicate top-k, bad ids), row permutes (16-byte and
2-byte paths, bad rows), unpermute + combine (every dtype, bit for bit), the multi-tensor power
sum (over the table libfsdpturbo builds) and the fused scale. What this cannot show (real
parallel timing, memory coalescing, the driver API launches) is for scripts/device_check.sh.
"""
import ctypes
import hashlib
import math
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

import fsdpturbo
from fsdpturbo._native import check, lib

ops = fsdpturbo.ops
ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the kernel emulation")

_i64p = ctypes.POINTER(ctypes.c_int64)


def _host_source():
    """The kernel sources with the device-only lines replaced by host equivalents."""
    kernels = ROOT / "src" / "backend" / "cuda" / "kernels"
    common = (kernels / "common.cuh").read_text()
    swaps = [('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));', "f = emu_f16_to_f32(h);"),
             ('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));', "h = emu_f32_to_f16(x);")]
    for old, new in swaps:
        assert old in common, f"common.cuh changed: update the emulation ({old})"
        common = common.replace(old, new)
    text = common + "".join((kernels / f"{n}.cu").read_text() for n in ("route", "permute", "norm"))
    text, n = re.subn(r"extern __shared__ (\w+) (\w+)\[\];", r"\1* \2 = (\1*)emu_dynamic_shared;", text)
    assert n == 2, "the kernels' dynamic shared arrays changed: update the emulation"
    return text


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    text = _host_source()
    digest = hashlib.sha256((text + (ROOT / "tests/cuda_emu/emu.cpp").read_text()
                             + (ROOT / "tests/cuda_emu/cuda_emu.h").read_text()).encode()).hexdigest()[:16]
    out = tmp_path_factory.mktemp("cuda_emu")
    src = out / "kernels_host.inc"
    src.write_text(text)
    so = out / f"emu_{digest}.so"
    subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", f"-I{ROOT}/tests/cuda_emu",
                    f'-DKERNELS_CU="{src}"', str(ROOT / "tests/cuda_emu/emu.cpp"), "-o", str(so)],
                   check=True, capture_output=True, text=True, timeout=300)
    e = ctypes.CDLL(str(so))
    e.emu_route.restype = e.emu_permute.restype = e.emu_unpermute.restype = ctypes.c_longlong
    e.emu_route.argtypes = [_i64p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int, ctypes.c_int, _i64p, _i64p, _i64p]
    e.emu_permute.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, _i64p, ctypes.c_uint64,
                              ctypes.c_int64, ctypes.c_void_p]
    e.emu_unpermute.argtypes = [ctypes.c_int, ctypes.c_void_p, _i64p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int,
                                ctypes.c_uint64, ctypes.c_void_p]
    e.emu_power_sum.restype = ctypes.c_double
    e.emu_power_sum.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_double,
                                ctypes.c_int]
    e.emu_scale.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_double]
    return e


def _p(t, kind=_i64p):
    return ctypes.cast(t.data_ptr(), kind) if t.numel() else None


CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}


@pytest.mark.parametrize("tokens,top_k,experts,ep", [(300, 4, 16, 4), (33, 2, 4, 4), (0, 2, 8, 2), (70, 8, 8, 1)])
def test_route(emu, tokens, top_k, experts, ep):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(1, experts, (tokens, top_k), generator=g)  # expert 0 gets nothing
    ids[::3, 0] = experts - 1  # a hot expert, duplicates within a token's top-k
    counts, perm, splits = (torch.full((n,), -7, dtype=torch.int64) for n in (experts, tokens * top_k, ep))
    assert emu.emu_route(_p(ids), tokens, top_k, experts, ep, _p(counts), _p(perm), _p(splits)) == -1
    want = ops.moe_route(ids, experts, ep)
    assert all(torch.equal(a, b) for a, b in zip((counts, perm, splits), want))


def test_route_reports_the_first_bad_id(emu):
    ids = torch.randint(0, 8, (40, 2), generator=torch.Generator().manual_seed(1))
    ids[30, 1], ids[7, 0] = 8, -3
    out = [torch.empty(n, dtype=torch.int64) for n in (8, 80, 2)]
    assert emu.emu_route(_p(ids), 40, 2, 8, 2, *(_p(t) for t in out)) == 14


@pytest.mark.parametrize("dtype,hidden", [(torch.bfloat16, 16), (torch.float32, 7), (torch.float64, 4)])
def test_permute(emu, dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(40, hidden, generator=g).to(dtype)
    _, perm, _ = ops.moe_route(torch.randint(0, 4, (40, 4), generator=g), 4, 2)
    out = torch.full((160, hidden), float("nan"), dtype=dtype)
    row_bytes = hidden * x.element_size()
    assert emu.emu_permute(x.data_ptr(), 40, row_bytes, _p(perm), 160, 4, out.data_ptr()) == -1
    assert torch.equal(out, ops.moe_permute(x, perm, 4))
    rows = torch.tensor([3, 39, 40, 2, 41])
    out = torch.empty(5, hidden, dtype=dtype)
    assert emu.emu_permute(x.data_ptr(), 40, row_bytes, _p(rows), 5, 1, out.data_ptr()) == 2


@pytest.mark.parametrize("dtype", list(CODES))
@pytest.mark.parametrize("hidden,weighted", [(16, True), (16, False), (5, True)])
def test_unpermute_is_the_host_kernel_bit_for_bit(emu, dtype, hidden, weighted):
    g = torch.Generator().manual_seed(hidden + weighted)
    tokens, top_k = 24, 4
    _, perm, _ = ops.moe_route(torch.randint(0, 8, (tokens, top_k), generator=g), 8, 2)
    y = torch.randn(tokens * top_k, hidden, generator=g).to(dtype)
    probs = torch.rand(tokens, top_k, generator=g).to(dtype) if weighted else None
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype)
    assert emu.emu_unpermute(CODES[dtype], y.data_ptr(), _p(perm), probs.data_ptr() if weighted else None, tokens,
                             top_k, hidden, out.data_ptr()) == -1
    assert torch.equal(out, ops.moe_unpermute(y, perm, probs, tokens, top_k))


def test_unpermute_reports_a_repeated_entry(emu):
    y = torch.randn(8, 4)
    perm = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6])
    assert emu.emu_unpermute(0, y.data_ptr(), _p(perm), None, 4, 2, 4, torch.empty(4, 4).data_ptr()) in (6, 7)


class _Grad(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("mut_data", ctypes.c_void_p), ("numel", ctypes.c_size_t),
                ("dtype", ctypes.c_int32), ("dims", ctypes.c_void_p), ("roles", ctypes.c_void_p),
                ("n_dims", ctypes.c_size_t)]


def _table(tensors):
    """The multi-tensor table libfsdpturbo builds (here over host addresses)."""
    arr = (_Grad * len(tensors))(*[_Grad(None, t.data_ptr() if t.numel() else None, t.numel(), CODES[t.dtype], None,
                                         None, 0) for t in tensors])
    fn = lib.fsdpturbo_cuda_multi_tensor_table
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
                   ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    words, chunks = ctypes.c_size_t(), ctypes.c_size_t()
    fn(arr, len(tensors), None, 0, ctypes.byref(words), ctypes.byref(chunks))
    table = (ctypes.c_uint64 * words.value)()
    check(fn(arr, len(tensors), table, words.value, ctypes.byref(words), ctypes.byref(chunks)))
    return table, chunks.value


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [65536 + 9, 3, 0, 1000, 131072 + 8]
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.float16, torch.float64]
    return [torch.randn(n, generator=g).to(d) for n, d in zip(sizes, dtypes)]


@pytest.mark.parametrize("p,kind", [(1.0, 0), (2.0, 1), (3.5, 2), (math.inf, 3)])
@pytest.mark.parametrize("acc_f64", [True, False])
def test_power_sum(emu, p, kind, acc_f64):
    ts = _tensors(int(p) if p != math.inf else 9)
    table, chunks = _table(ts)
    got = emu.emu_power_sum(table, len(ts), chunks, kind, p, int(acc_f64))
    want = float(ops.power_sum(ts, p, acc_f64))
    if p == math.inf:
        assert got == want
    elif acc_f64:
        assert abs(got - want) <= 1e-12 * want  # f64 sums in another order
    else:  # f32 partial sums: each side within f32 rounding of the exact value
        exact = sum(t.double().abs().pow(p).sum().item() for t in ts)
        assert abs(got - exact) <= 1e-5 * exact and abs(want - exact) <= 1e-5 * exact
    ts[0][70] = float("nan")
    assert math.isnan(emu.emu_power_sum(table, len(ts), chunks, kind, p, int(acc_f64)))


@pytest.mark.parametrize("coef", [0.37, 3e-5])
def test_scale(emu, coef):
    ts = _tensors(5)
    host = [t.clone() for t in ts]
    table, chunks = _table(ts)
    emu.emu_scale(table, len(ts), chunks, coef)
    ops.foreach_scale_(host, coef)
    for a, b in zip(ts, host):
        assert torch.equal(a, b)
