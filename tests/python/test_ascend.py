"""The NPU kernels (torch_ext/csrc/npu_ops.cpp) and the mc2 dispatcher run end to end on CPU
tensors over fsdpturbo's C test doubles of CANN (csrc/testing, built by CMake): the production
C++/Rust call sequence, with the doubles checking every call and computing real results. The
fused and mc2 dispatchers are compared with the eager dispatcher on gloo ranks."""
import ctypes
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks

REPO = pathlib.Path(__file__).resolve().parents[2]
DOUBLE_DIR = pathlib.Path(os.environ.get("FSDPTURBO_ASCEND_DOUBLE_DIR", REPO / "build" / "ascend_double"))
if not (DOUBLE_DIR / "libopapi.so").is_file():
    pytest.skip(f"the Ascend test doubles are not built (no {DOUBLE_DIR}/libopapi.so): build with CMake",
                allow_module_level=True)


def _use_double(log):
    os.environ.update(FSDPTURBO_ACL_PATH=str(DOUBLE_DIR / "libascendcl.so"),
                      FSDPTURBO_HCCL_PATH=str(DOUBLE_DIR / "libhccl.so"),
                      FSDPTURBO_OPAPI_PATH=str(DOUBLE_DIR / "libopapi.so"),
                      FSDPTURBO_NNOPBASE_PATH=str(DOUBLE_DIR / "libnnopbase.so"),
                      FSDPTURBO_DOUBLE_LOG=str(log))
    from fsdpturbo import mc2

    mc2.enable_test_double()


def _log(path):
    return path.read_text().splitlines() if path.exists() else []


def _live_objects():
    return ctypes.CDLL(str(DOUBLE_DIR / "libopapi.so")).fsdpturbo_double_live_objects()


def _check_protocol(lines):
    """What the double enforces call by call, checked again over the whole log: no violation,
    every launch after its own GetWorkspaceSize with the size it gave, each executor launched once,
    on the stream of the test double; nothing left alive."""
    assert not [l for l in lines if l.startswith("VIOLATION")], lines
    sizes, launched = {}, set()
    for line in lines:
        m = re.match(r"aclnnGroupedMatmulV5GetWorkspaceSize .* -> workspace=(\d+) (E\d+)$", line)
        if m:
            sizes[m.group(2)] = m.group(1)
        m = re.match(r"aclnnGroupedMatmulV5 workspace=(\d+) (E\d+) stream=(S\d+)$", line)
        if m:
            assert sizes.get(m.group(2)) == m.group(1) and m.group(2) not in launched, line
            launched.add(m.group(2))
    assert launched == set(sizes), "every executor is launched exactly once"
    assert len({l.split("stream=")[1].split()[0] for l in lines if "stream=" in l}) <= 1, "one stream"
    assert _live_objects() == 0


def test_test_mode_is_refused_without_the_double(tmp_path):
    """The switch onto the doubles fails with real (here: missing or foreign) libraries."""
    code = ("import torch, fsdpturbo.mc2 as m\n"
            "try:\n    m.enable_test_double()\nexcept RuntimeError as e:\n    print('REFUSED', e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDPTURBO_") or k.endswith("LIB")}
    env.update(ASCEND_HOME_PATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "REFUSED" in out.stdout and "is not available on this host" in out.stdout, out.stdout + out.stderr
    env.update(FSDPTURBO_ACL_PATH=str(DOUBLE_DIR / "libascendcl.so"), FSDPTURBO_HCCL_PATH=str(DOUBLE_DIR / "libhccl.so"),
               FSDPTURBO_OPAPI_PATH=str(DOUBLE_DIR / "libopapi.so"), FSDPTURBO_NNOPBASE_PATH="libc.so.6")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "REFUSED" in out.stdout and "aclDestroyAclOpExecutor" in out.stdout, out.stdout + out.stderr


def _grouped_mm_rank(rank, world, log_dir):
    log = pathlib.Path(log_dir) / "gmm.log"
    _use_double(log)
    from fsdpturbo._native import ops

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 2, 1])  # an expert with no rows
    x = torch.randn(6, 5, generator=g, requires_grad=True)
    w = torch.randn(4, 7, 5, generator=g, requires_grad=True)  # [G, out, in]
    y = ops.grouped_mm(x, counts, w)
    cot = torch.randn(6, 7, generator=g)
    (y * cot).sum().backward()
    # Oracle: torch matmuls per group.
    xr, wr = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    bounds = [0, 3, 3, 5, 6]
    yr = torch.cat([xr[bounds[e]:bounds[e + 1]] @ wr[e].T for e in range(4)])
    (yr * cot).sum().backward()
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)
    lines = _log(log)
    _check_protocol(lines)
    first = [re.sub(r"([TLE])\d+", r"\1", l) for l in lines[1:9]]
    assert lines[0].startswith("aclrtCreateStream S"), lines
    assert first == [
        "aclCreateTensor T dtype=0 dims=[6,5] strides=[5,1] offset=0 format=2 storage=[30]",
        "aclCreateTensorList L [T]",
        "aclCreateTensor T dtype=0 dims=[4,5,7] strides=[35,1,5] offset=0 format=2 storage=[140]",
        "aclCreateTensorList L [T]",
        "aclCreateTensor T dtype=9 dims=[4] strides=[1] offset=0 format=2 storage=[4]",
        "aclCreateTensor T dtype=0 dims=[6,7] strides=[7,1] offset=0 format=2 storage=[42]",
        "aclCreateTensorList L [T]",
        "aclnnGroupedMatmulV5GetWorkspaceSize x=L weight=L groupList=T splitItem=2 groupType=0 groupListType=1 "
        "actType=0 out=L -> workspace=512 E",
    ], lines
    # The weight gradient: x^T as a transposed view, split along K (groupType 2, splitItem 3).
    assert any(re.fullmatch(r"aclCreateTensor T\d+ dtype=0 dims=\[5,6\] strides=\[1,5\] offset=0 format=2 "
                            r"storage=\[30\]", l) for l in lines), lines
    assert any("splitItem=3 groupType=2 groupListType=1" in l for l in lines), lines
    assert sum(l.startswith("aclnnGroupedMatmulV5 ") for l in lines) == 3  # forward, dX, dW
    # bfloat16 reaches aclnn as ACL_BF16 (27); the double rounds its f64 sums once.
    yb = ops.grouped_mm(x.detach().bfloat16(), counts, w.detach().bfloat16())
    torch.testing.assert_close(yb.float(), yr.detach(), rtol=2e-2, atol=5e-2)
    assert re.fullmatch(r"aclCreateTensor T\d+ dtype=27 dims=\[6,5\] .*", _log(log)[len(lines) + 0]), _log(log)
    from fsdpturbo._native import lib
    version = ctypes.c_uint32()
    assert lib.fsdpturbo_npu_grouped_matmul_version(ctypes.byref(version)) == 0 and version.value == 5


def test_grouped_mm_runs_aclnn_through_the_double(tmp_path):
    run_ranks(_grouped_mm_rank, 1, str(tmp_path))


def _dispatchers_rank(rank, world, route_name, log_dir):
    from test_ep import ROUTES, TOKENS_PER_RANK, _block, _data, _override_router

    import fsdpturbo
    from fsdpturbo.ep import EPPlanConfig, expert_parallelize_modules

    log = pathlib.Path(log_dir) / f"rank{rank}.log"
    _use_double(log)
    route = ROUTES.get(route_name) or SPARSE_ROUTES.get(route_name)
    state = fsdpturbo.ParallelState(world, ep_size=world).init_device_meshes("cpu")
    ep_mesh = state.sub_mesh("ep")
    x_all, cotangent = _data(world, torch.float32)
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    results, segments = {}, {}
    for dispatcher in ("eager", "fused", "mc2"):
        block = _block(8, 2, torch.float32)
        if route is not None:
            _override_router(block, lambda t: route(world * TOKENS_PER_RANK)[rank * t:(rank + 1) * t])
        expert_parallelize_modules(block, ep_mesh, EPPlanConfig(apply_modules=["experts"], dispatcher=dispatcher))
        x = x_all[rows].clone().requires_grad_(True)
        before = len(_log(log))
        out = block(x.unsqueeze(0)).squeeze(0)
        (out * cotangent[rows]).sum().backward()
        segments[dispatcher] = _log(log)[before:]
        results[dispatcher] = [out.detach(), x.grad] + [
            getattr(block.experts, n).grad.to_local() for n in ("gate_up_proj", "down_proj")] + [
            p.grad for n, p in block.named_parameters() if not n.startswith("experts.")]
    for dispatcher in ("fused", "mc2"):
        for got, want in zip(results[dispatcher], results["eager"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _check_protocol(_log(log))
    received = any("aclnnGroupedMatmulV5 " in l for l in segments["mc2"])
    mc2_launches = sum(l.startswith("aclnnGroupedMatmulV5 ") for l in segments["mc2"])
    assert mc2_launches == (6 if received else 0), segments["mc2"]  # 2 forward, 2 dX, 2 dW
    a2a = [l for l in segments["mc2"] if l.startswith("HcclAlltoAllV ")]
    assert len(a2a) == 4 and all(f"rank={rank} " in l for l in a2a), a2a  # forward 2, backward 2
    assert not any(l.startswith("Hccl") for l in segments["fused"]), "fused moves tokens through c10d"
    # Rows of [hidden 16] per rank: the all-to-all counts are in elements, host uint64 arrays.
    m = re.match(r"HcclAlltoAllV sendCounts=\[([\d,]+)\] sdispls=\[([\d,]+)\]", a2a[0])
    counts = [int(v) for v in m.group(1).split(",")]
    displs = [int(v) for v in m.group(2).split(",")]
    assert len(counts) == world and all(c % 16 == 0 for c in counts)
    assert displs == [sum(counts[:i]) for i in range(world)]
    dist.barrier()


SPARSE_ROUTES = {
    # Experts 1, 3, 4, 6, 7 receive nothing; every rank still receives rows.
    "sparse": lambda t: torch.tensor([[0, 5], [2, 0], [5, 2]] * (t // 3) + [[0, 2]] * (t % 3)),
}


@pytest.mark.parametrize("world,route", [(2, "sparse"), (4, "skewed")])
def test_fused_and_mc2_through_the_double_equal_eager(world, route, tmp_path):
    run_ranks(_dispatchers_rank, world, route, str(tmp_path))


def test_mc2_checks_shapes_and_dtypes_before_launch():
    from fsdpturbo import mc2

    x, w = torch.zeros(5, 4), torch.zeros(2, 6, 4)
    with pytest.raises(ValueError, match=r"alltoallv_gmm: x \[rows, in\] and weight \[local experts, out, in\] "
                                         r"expected, got \(5, 3\) and \(2, 6, 4\)"):
        mc2.alltoallv_gmm(torch.zeros(5, 3), w, 0, 2, [1, 1, 1, 2], [1, 1, 1, 2])
    with pytest.raises(ValueError, match=r"one dtype of bfloat16, float16 or float32 .* torch.float64"):
        mc2.alltoallv_gmm(x.double(), w.double(), 0, 2, [1, 1, 1, 2], [1, 1, 1, 2])
    with pytest.raises(ValueError, match=r"recv_counts has 3 entries; ep size 2 × 2 local experts = 4"):
        mc2.alltoallv_gmm(x, w, 0, 2, [1, 1, 1, 2], [1, 1, 1])
    with pytest.raises(ValueError, match=r"send_counts sum to 4 rows but x has 5"):
        mc2.alltoallv_gmm(x, w, 0, 2, [1, 1, 1, 1], [1, 1, 1, 2])
    with pytest.raises(ValueError, match=r"gmm_alltoallv: recv_counts sum to 5 rows but y has 3"):
        mc2.gmm_alltoallv(torch.zeros(3, 4), w, 0, 2, [1, 1, 1, 2], [1, 1, 1, 2], None)
    with pytest.raises(NotImplementedError, match=r"hccl_all_to_all_v runs on Ascend NPU tensors"):
        torch.ops.fsdpturbo.hccl_all_to_all_v(x, 1, [5], [5])
