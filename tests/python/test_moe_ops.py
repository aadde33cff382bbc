"""The MoE ops of the op library: the seed's worked example (P=2, E=4, K=2) number for number,
opcheck for every op, gradcheck in f64, and clear errors; and the experts' SiLU gate, which must
give autograd's own bits."""
import pytest
import torch
from torch.autograd import gradcheck

import fsdpturbo  # noqa: F401  (loads the op library)

ops = torch.ops.fsdpturbo
pytestmark = pytest.mark.parity  # also run on the other instruction sets (ctest parity_*)


def test_seed_worked_example():
    counts, permutation, splits = ops.moe_route(torch.tensor([[1, 2], [0, 3], [2, 1]]), 4, 2)
    assert counts.tolist() == [1, 2, 2, 1] and splits.tolist() == [3, 3]
    assert permutation.tolist() == [2, 0, 5, 1, 4, 3]
    assert (permutation // 2).tolist() == [1, 0, 2, 0, 2, 1]  # permuted rows are these tokens
    counts1, _, splits1 = ops.moe_route(torch.tensor([[3, 0], [2, 3]]), 4, 2)
    assert counts1.tolist() == [1, 0, 1, 2] and splits1.tolist() == [1, 3]
    # What each rank receives from these counts: test_receive.py.

def _inputs():
    ids = torch.tensor([[1, 2], [0, 3], [2, 1], [3, 3]])
    _, permutation, _ = ops.moe_route(ids, 4, 2)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(4, 2, dtype=torch.float64, requires_grad=True)
    return ids, permutation, x, probs


def test_opcheck_every_moe_op():
    ids, permutation, x, probs = _inputs()
    permuted = ops.moe_permute(x, permutation, 2).detach().requires_grad_()
    counts = torch.tensor([3, 0, 5])
    w = torch.randn(3, 6, 5, dtype=torch.float64, requires_grad=True)
    a = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    for op, args in [(ops.moe_route.default, (ids, 4, 2)),
                     (ops.moe_permute.default, (x, permutation, 2)),
                     (ops.moe_unpermute.default, (permuted, permutation, probs, 4, 2)),
                     (ops.moe_unpermute.default, (permuted, permutation, None, 4, 2)),
                     (ops.grouped_mm.default, (a, counts, w)),
                     (ops.grouped_mm_grad_input.default, (torch.randn(8, 6, dtype=torch.float64), counts, w)),
                     (ops.grouped_mm_grad_weight.default, (torch.randn(8, 6, dtype=torch.float64), a, counts)),
                     (ops.moe_token_permute.default, (x, ids)),
                     (ops.moe_token_unpermute.default, (permuted, ops.moe_token_permute(x, ids)[1], probs)),
                     (ops.moe_token_unpermute.default, (permuted, ops.moe_token_permute(x, ids)[1], None))]:
        torch.library.opcheck(op, args)


def test_gradcheck_f64():
    _, permutation, x, probs = _inputs()
    assert gradcheck(lambda x, p: ops.moe_unpermute(ops.moe_permute(x, permutation, 2), permutation, p, 4, 2),
                     (x, probs))
    ids = _inputs()[0]
    assert gradcheck(lambda x, p: ops.moe_token_unpermute(*ops.moe_token_permute(x, ids), p), (x, probs))
    counts = torch.tensor([2, 0, 3])  # an empty group: zero rows, zero weight gradient
    a = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 6, 4, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda a, w: ops.grouped_mm(a, counts, w), (a, w))
    ops.grouped_mm(a, counts, w).sum().backward()
    assert torch.count_nonzero(w.grad[1]) == 0


def test_unpermute_is_the_weighted_sum_over_k():
    _, permutation, x, probs = _inputs()
    out = ops.moe_unpermute(ops.moe_permute(x, permutation, 2), permutation, probs, 4, 2)
    torch.testing.assert_close(out, (x.unsqueeze(1) * probs.unsqueeze(-1)).sum(1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_silu_gate_gives_the_bits_of_autograd_on_silu_times_up(dtype):
    from fsdpturbo.moe.dispatch.experts import activation

    module = torch.nn.Module()
    module.act_fn = torch.nn.SiLU()
    gate_up = torch.randn(37, 2 * 23, dtype=dtype, requires_grad=True)
    grad = torch.randn(37, 23, dtype=dtype)
    ours = activation(module, gate_up)
    (ours_grad,) = torch.autograd.grad(ours, gate_up, grad)
    assert type(ours.grad_fn).__name__ == "_SiluGateBackward"  # the fused function ran
    gate, up = gate_up.chunk(2, dim=-1)
    reference = torch.nn.functional.silu(gate) * up
    (reference_grad,) = torch.autograd.grad(reference, gate_up, grad)
    assert torch.equal(ours, reference) and torch.equal(ours_grad, reference_grad)


def test_errors_name_what_and_where():
    with pytest.raises(ValueError, match=r"4.*token 1.*k 1|token 1.*4"):
        ops.moe_route(torch.tensor([[0, 1], [2, 4]]), 4, 2)
    with pytest.raises(ValueError, match=r"Number of experts\(6\) is not divisible by ep size\(4\)\."):
        ops.moe_route(torch.tensor([[0, 1]]), 6, 4)
    with pytest.raises(ValueError, match=r"permuted tokens\(3\) != sorted indices\(4\)"):
        ops.moe_unpermute(torch.randn(3, 2), torch.arange(4), None, 2, 2)
    with pytest.raises(ValueError, match=r"expected float32, float64, float16 or bfloat16"):
        ops.grouped_mm(torch.ones(2, 2, dtype=torch.int32), torch.tensor([2]), torch.ones(1, 2, 2, dtype=torch.int32))
