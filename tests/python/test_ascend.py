"""The NPU kernels (torch_ext/csrc/npu_ops.cpp) and the mc2 dispatcher run end to end on CPU
tensors over fsdpturbo's C test doubles of CANN (tests/doubles, built by CMake): the production
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

from ascend_double import BUILT, DOUBLE_DIR, NOT_BUILT, use_double
from dist_util import run_ranks
from blocks import ROUTES, TOKENS_PER_RANK, block_data, moe_block, override_router

if not BUILT:
    pytest.skip(NOT_BUILT, allow_module_level=True)


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
        m = re.match(r"(aclnn\w+)GetWorkspaceSize .* -> workspace=(\d+) (E\d+)$", line)
        if m:
            sizes[m.group(3)] = (m.group(1), m.group(2))
        m = re.match(r"(aclnn\w+) workspace=(\d+) (E\d+) stream=(S\d+)$", line)
        if m:
            assert sizes.get(m.group(3)) == (m.group(1), m.group(2)) and m.group(3) not in launched, line
            launched.add(m.group(3))
    assert launched == set(sizes), "every executor is launched exactly once"
    assert len({l.split("stream=")[1].split()[0] for l in lines if "stream=" in l}) <= 1, "one stream"
    assert _live_objects() == 0


def test_test_mode_is_refused_without_the_double(tmp_path):
    """The switch onto the doubles fails with real (here: missing or foreign) libraries."""
    code = ("import torch, fsdpturbo.moe.dispatch.device as m\n"
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
    use_double(log)
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
    assert lib.fsdpturbo_npu_grouped_mm_version(ctypes.byref(version)) == 0 and version.value == 5


def test_grouped_mm_runs_aclnn_through_the_double(tmp_path):
    run_ranks(_grouped_mm_rank, 1, str(tmp_path))


def _run_block(block, x_rows, cotangent_rows, log):
    x = x_rows.clone().requires_grad_(True)
    before = len(_log(log))
    out = block(x.unsqueeze(0)).squeeze(0)
    (out * cotangent_rows).sum().backward()
    grads = [getattr(block.experts, n).grad.to_local() for n in ("gate_up_proj", "down_proj")]
    grads += [p.grad for n, p in block.named_parameters() if not n.startswith("experts.")]
    return [out.detach(), x.grad] + grads, _log(log)[before:]


def _launches(lines, op):
    return sum(l.startswith(op + " workspace=") for l in lines)


def _dispatchers_rank(rank, world, route_name, log_dir):

    import fsdpturbo
    from fsdpturbo.ep import EPPlanConfig, expert_parallelize_modules

    log = pathlib.Path(log_dir) / f"rank{rank}.log"
    use_double(log)
    route = ROUTES.get(route_name) or SPARSE_ROUTES.get(route_name)
    state = fsdpturbo.ParallelState(world, ep_size=world).init_device_meshes("cpu")
    ep_mesh = state.sub_mesh("ep")
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    results, segments = {}, {}
    # fused against eager in float32; mc2 (bfloat16 or float16 only) against eager in bfloat16.
    for dispatcher, dtype in (("eager", torch.float32), ("fused", torch.float32), ("eager", torch.bfloat16),
                              ("mc2", torch.bfloat16)):
        block = moe_block(8, 2, dtype)
        if route is not None:
            override_router(block, lambda t: route(world * TOKENS_PER_RANK)[rank * t:(rank + 1) * t])
        expert_parallelize_modules(block, ep_mesh, EPPlanConfig(apply_modules=["experts"], dispatcher=dispatcher))
        x_all, cotangent = block_data(world, dtype)
        results[dispatcher, dtype], segments[dispatcher] = _run_block(block, x_all[rows], cotangent[rows], log)
    for got, want in zip(results["fused", torch.float32], results["eager", torch.float32]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(results["mc2", torch.bfloat16], results["eager", torch.bfloat16]):
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    _check_protocol(_log(log))

    fused, mc2 = segments["fused"], segments["mc2"]
    assert not any(l.startswith("Hccl") for l in fused), "fused moves tokens through c10d"
    # mc2: the rows travel inside the fused operators only, over the group's communicator (by name).
    assert not any(l.startswith("HcclAlltoAllV ") for l in mc2), mc2
    assert _launches(mc2, "aclnnAlltoAllvGroupedMatMul") == 2 and _launches(mc2, "aclnnGroupedMatMulAlltoAllv") == 2
    assert (_launches(mc2, "aclnnMoeTokenPermute"), _launches(mc2, "aclnnMoeTokenUnpermute")) == (1, 2), mc2
    first = next(l for l in mc2 if l.startswith("aclnnAlltoAllvGroupedMatMulGetWorkspaceSize"))
    m = re.search(r"group=(\S+) epWorldSize=(\d+) sendCounts=\[([\d,]+)\] recvCounts=\[([\d,]+)\] "
                  r"transGmmWeight=1 permuteOutFlag=1", first)
    assert m and int(m.group(2)) == world, first
    send = [int(v) for v in m.group(3).split(",")]
    assert len(send) == 8 and sum(send) == TOKENS_PER_RANK * 2, first  # my rows per global expert
    received = sum(int(v) for v in m.group(4).split(","))
    # The two weight gradients, split along K; a rank that received nothing has zero gradients.
    assert _launches(mc2, "aclnnGroupedMatmulV5") == (2 if received else 0), mc2
    # fused: the token permute and the combine, then (on rows received) the local-expert permute
    # and its combine; each permute's backward is an unpermute.
    want = (2, 4) if received else (1, 2)
    assert (_launches(fused, "aclnnMoeTokenPermute"), _launches(fused, "aclnnMoeTokenUnpermute")) == want, fused
    a2a = [l for l in mc2 if l.startswith("aclnnAlltoAllvGroupedMatMul/all-to-all ")]
    counts = [int(v) for v in re.search(r"sendCounts=\[([\d,]+)\]", a2a[0]).group(1).split(",")]
    assert counts == [16 * sum(send[p * (8 // world):(p + 1) * (8 // world)]) for p in range(world)], a2a[0]
    dist.barrier()


SPARSE_ROUTES = {
    # Experts 1, 3, 4, 6, 7 receive nothing; every rank still receives rows.
    "sparse": lambda t: torch.tensor([[0, 5], [2, 0], [5, 2]] * (t // 3) + [[0, 2]] * (t % 3)),
}


@pytest.mark.parametrize("world,route", [(2, "sparse"), (4, "skewed")])
def test_fused_and_mc2_through_the_double_equal_eager(world, route, tmp_path):
    run_ranks(_dispatchers_rank, world, route, str(tmp_path))


def test_mc2_ops_need_an_npu():
    from fsdpturbo._native import ops

    x, w = torch.zeros(5, 4, dtype=torch.bfloat16), torch.zeros(2, 6, 4, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"alltoallv_grouped_mm runs on Ascend NPU tensors \(MC2\); got cpu"):
        ops.alltoallv_grouped_mm(x, w, "g", 2, [1, 1, 1, 2], [1, 1, 1, 2], True)


def _mc2_checks_rank(rank, world, log_dir):
    use_double(pathlib.Path(log_dir) / "checks.log")
    from fsdpturbo.moe.dispatch import mc2
    from fsdpturbo._native import ops

    x, w = torch.zeros(5, 4, dtype=torch.bfloat16), torch.zeros(2, 6, 4, dtype=torch.bfloat16)
    call = ops.alltoallv_grouped_mm
    with pytest.raises(ValueError, match=r"alltoallv_grouped_mm: x has 3 columns but the weight "
                                         r"\(\[experts, out, in\]\) takes 4"):
        call(torch.zeros(5, 3, dtype=torch.bfloat16), w, "g", 2, [1, 1, 1, 2], [1, 1, 1, 2], True)
    with pytest.raises(ValueError, match=r"take bfloat16 or float16 \(one dtype\), got Float and Float"):
        call(x.float(), w.float(), "g", 2, [1, 1, 1, 2], [1, 1, 1, 2], True)
    with pytest.raises(ValueError, match=r"need 2 local experts x 2 ranks = 4 entries, got 4 and 3"):
        call(x, w, "g", 2, [1, 1, 1, 2], [1, 1, 1], True)
    with pytest.raises(ValueError, match=r"send_counts sum to 4 rows but x has 5"):
        call(x, w, "g", 2, [1, 1, 1, 1], [1, 1, 1, 2], True)
    with pytest.raises(ValueError, match=r"at most 32 local experts and 256 counts, got 33 x 1"):
        call(x, torch.zeros(33, 6, 4, dtype=torch.bfloat16), "g", 1, [5] + [0] * 32, [0] * 33, True)
    with pytest.raises(ValueError, match=r"grouped_mm_alltoallv: send_counts sum to 5 rows but x has 3"):
        ops.grouped_mm_alltoallv(torch.zeros(3, 4, dtype=torch.bfloat16), w, "g", 2, [1, 1, 1, 2], [1, 1, 1, 2],
                                 True)
    mc2.check_ep_size(4)  # the double runs any ep size
    lines = _log(pathlib.Path(log_dir) / "checks.log")
    assert not [l for l in lines if "aclnn" in l or l.startswith("aclCreate")], "nothing reached aclnn"


def test_mc2_checks_shapes_and_dtypes_before_launch(tmp_path):
    run_ranks(_mc2_checks_rank, 1, str(tmp_path))


def test_token_permute_and_unpermute_on_cpu_follow_the_seed_contract():
    """The ATen kernels (every device without aclnn): sorted_indices gives each flat slot its row;
    the gradients of both ops match autograd through plain torch ops."""
    from fsdpturbo._native import ops

    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[2, 0], [1, 2], [0, 0], [2, 1]])
    probs = torch.rand(4, 2, generator=g, dtype=torch.float64, requires_grad=True)
    permuted, rows = ops.moe_token_permute(tokens, ids)
    assert rows.dtype == torch.int32
    order = torch.argsort(ids.reshape(-1), stable=True)
    torch.testing.assert_close(permuted, tokens.repeat_interleave(2, 0)[order])
    torch.testing.assert_close(rows.long(), torch.argsort(order))
    out = ops.moe_token_unpermute(permuted, rows, probs)
    want = (tokens.unsqueeze(1) * probs.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(out, want)
    cot = torch.randn(4, 3, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * cot).sum(), (tokens, probs))
    expected = torch.autograd.grad((want * cot).sum(), (tokens, probs))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match=r"indices must be integer expert ids \[4\] or \[4, top_k\]"):
        ops.moe_token_permute(tokens, ids.float())
    with pytest.raises(ValueError, match=r"probs must be \[tokens, top_k\] with tokens \* top_k = 8"):
        ops.moe_token_unpermute(permuted, rows, probs[:3])


def _comm_name_rank(rank, world):
    from fsdpturbo.moe.dispatch import mc2

    with pytest.raises(ValueError, match=r"ep size of 8, 16, 32, 64 \(Atlas A3\), got 4; use the 'fused'"):
        mc2.check_ep_size(4)
    mc2.check_ep_size(16)

    torch.utils.rename_privateuse1_backend("npu")  # what importing torch_npu does
    calls = []

    class Backend:
        def get_hccl_comm_name(self, global_rank):
            calls.append(("get_hccl_comm_name", global_rank))
            return "hccl_world_group_7"

    class Group:
        def _get_backend(self, device):
            calls.append(("_get_backend", device))
            return Backend()

    group = Group()
    assert mc2.comm_name(group) == "hccl_world_group_7" and mc2.comm_name(group) == "hccl_world_group_7"
    assert calls == [("_get_backend", torch.device("npu")), ("get_hccl_comm_name", dist.get_rank())]  # cached
    with pytest.raises(RuntimeError, match=r"no HCCL backend with get_hccl_comm_name .* backend 'hccl' under "
                                           r"torch_npu"):
        mc2.comm_name(dist.group.WORLD)  # gloo: no npu backend


def test_mc2_takes_the_process_groups_hccl_comm_name():
    """On an NPU the name comes from torch_npu's ProcessGroupHCCL, as the seed reads it:
    group._get_backend(torch.device("npu")).get_hccl_comm_name(global rank)."""
    run_ranks(_comm_name_rank, 1)
