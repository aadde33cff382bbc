"""The capacity-bounded dispatch on a GPU (scripts/device_check.sh runs this on a lent H200):
forward and backward reach no host sync (`torch.cuda.set_sync_debug_mode("error")`), are
captured in one CUDA graph and replayed on new data equal to eager, and compile with
`fullgraph=True` equal to eager (and the dropless dispatchers compile equal to eager). One rank (NCCL). Skipped without CUDA; the CPU twins are
test_capacity.py (a host-sync detector on forward and backward) and test_compile.py."""
import pytest
import torch
import torch.distributed as dist

from fsdpturbo.moe.dispatch import Capacity
from blocks import ep_block

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS, HIDDEN = 64, 16


def _assert_close(actual, expected, what):
    """Per element within 1e-6 of itself, floored at 2e-6 of the tensor's largest element
    (compiled and eager round differently; replayed graphs run eager's kernels)."""
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=2e-6 * expected.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def ep_mesh():
    import os

    from dist_util import _free_port
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield init_device_mesh("cuda", (1,), mesh_dim_names=("ep",))["ep"]
    dist.destroy_process_group()


CAPACITY = Capacity(factor=2.0)


def _inputs(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(TOKENS, HIDDEN, device="cuda", generator=g),
            torch.randn(TOKENS, HIDDEN, device="cuda", generator=g))


def _step(block, x, cotangent):
    x = x.detach().requires_grad_(True)
    out = block(x.unsqueeze(0)).squeeze(0)
    (out * cotangent).sum().backward()
    return [out.detach(), x.grad, block.gate.weight.grad, block.experts.gate_up_proj.grad.to_local()]


@pytest.mark.parametrize("dispatcher", ["eager", "fused"])
def test_no_host_sync_in_forward_and_backward(ep_mesh, dispatcher):
    block = ep_block(ep_mesh, dispatcher, CAPACITY, torch.float32)
    x, cotangent = _inputs(0)
    _step(block, x, cotangent)  # first calls may allocate and load kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        block.zero_grad(set_to_none=True)
        _step(block, x, cotangent)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("dispatcher", ["eager", "fused"])
def test_captured_in_a_cuda_graph_and_replayed_equals_eager(ep_mesh, dispatcher):
    block, reference = (ep_block(ep_mesh, dispatcher, CAPACITY, torch.float32) for _ in range(2))
    static_x, static_cotangent = _inputs(0)
    static_x.requires_grad_(True)

    def step():
        out = block(static_x.unsqueeze(0)).squeeze(0)
        (out * static_cotangent).sum().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (the allocator's and the kernels' first use)
        for _ in range(3):
            block.zero_grad(set_to_none=True)
            static_x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    block.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in (1, 2):
        x, cotangent = _inputs(seed)
        with torch.no_grad():
            static_x.copy_(x)
            static_cotangent.copy_(cotangent)
        graph.replay()
        reference.zero_grad(set_to_none=True)
        want = _step(reference, x, cotangent)
        got = [static_out, static_x.grad, block.gate.weight.grad, block.experts.gate_up_proj.grad.to_local()]
        for label, a, b in zip(("output", "input grad", "router grad", "gate_up grad"), got, want):
            _assert_close(a, b, f"{dispatcher} replay {seed} {label}")


@pytest.mark.parametrize("dispatcher,capacity", [("eager", Capacity(factor=2.0)), ("fused", Capacity(factor=2.0)),
                                                 ("eager", None), ("fused", None), ("domino", None)])
def test_compile_equals_eager(ep_mesh, dispatcher, capacity):
    """fullgraph with a capacity; the dropless dispatchers break once, at the host read."""
    eager, compiled = (ep_block(ep_mesh, dispatcher, capacity, torch.float32) for _ in range(2))
    run = torch.compile(compiled, fullgraph=capacity is not None)
    x, cotangent = _inputs(3)
    for label, a, b in zip(("output", "input grad", "router grad", "gate_up grad"), _step(run, x, cotangent),
                           _step(eager, x, cotangent)):
        _assert_close(a, b, f"{dispatcher} compiled {label}")
