"""fsdpturbo.parity itself, in one process: the float64 mode really computes in float64 and takes
the recorded routes, and the gate's bound, messages and refusals. Its teeth on real faults of
the engine are test_train's test_parity_gate_rejects_..."""
import pytest
import torch

from fsdpturbo import parity


class _Upcasting(torch.nn.Module):
    """What Hugging Face's norms and routers do: compute in an explicit float32."""

    def forward(self, x):
        probs = torch.softmax(x.to(torch.float32), dim=-1, dtype=torch.float)
        return probs.float() * torch.ones(x.shape[-1], dtype=torch.float32)


def test_float64_mode_promotes_explicit_float32_requests():
    x = torch.randn(3, 5, dtype=torch.float64)
    plain = _Upcasting()(x)
    assert plain.dtype == torch.float32
    with parity.float64_mode():
        promoted = _Upcasting()(x)
        assert torch.zeros(2).dtype == torch.float64  # the default dtype too
    assert promoted.dtype == torch.float64
    assert torch.equal(promoted, torch.softmax(x, -1))
    assert torch.get_default_dtype() == torch.float32  # restored


def test_float64_mode_replays_the_recorded_top_k():
    scores32 = torch.tensor([[0.5, 0.2, 0.3]])
    routes = []
    with parity.recording_routes(routes):
        torch.topk(scores32, 2, dim=-1)
    assert [r.tolist() for r in routes] == [[[0, 2]]]
    tipped = torch.tensor([[0.2, 0.5, 0.3]], dtype=torch.float64)  # a run that would choose [1, 2]
    with parity.float64_mode(replay=routes):
        values, ids = torch.topk(tipped, 2, dim=-1)
    assert ids.tolist() == [[0, 2]] and values.tolist() == [[0.2, 0.3]]
    with pytest.raises(RuntimeError, match="more top-k calls than the float32 run recorded"):
        with parity.float64_mode(replay=[]):
            torch.topk(tipped, 2)
    with pytest.raises(RuntimeError, match=r"do not fit the scores \(2, 3\)"):
        with parity.float64_mode(replay=routes):
            torch.topk(torch.rand(2, 3, dtype=torch.float64), 2)


def _gate():
    ref64 = {"w": torch.tensor([[1.0, -2.0], [1e-9, 4.0]], dtype=torch.float64)}
    ref32 = {"w": ref64["w"] + torch.tensor([[1e-7, 0.0], [0.0, -2e-7]], dtype=torch.float64)}
    return parity.gate(ref64, [ref32])


def test_gate_bound_and_message():
    gate = _gate()
    # C × (largest reference rounding 2e-7 + 2^-24 |ref|): element [1, 0] may be off by about C × 2e-7
    within, beyond = 0.9 * parity.C * 2e-7, 1.1 * parity.C * 2e-7
    gate.check("w", torch.tensor([[1.0, -2.0], [1e-9 + within, 4.0]], dtype=torch.float64))
    gate.check("w", torch.tensor([[1.0, -2.0], [1e-9, 4.0]], dtype=torch.float64))  # exact
    with pytest.raises(parity.ParityError, match=r"step 3 w\[1, 0\] is .*the float64 reference 1e-09.*"
                                                 r"\(1 of 4 elements out\)"):
        gate.check("w", torch.tensor([[1.0, -2.0], [1e-9 + beyond, 4.0]], dtype=torch.float64), "step 3")
    with pytest.raises(parity.ParityError, match=r"w: shape \(4,\), expected \(2, 2\)"):
        gate.check("w", torch.zeros(4))
    with pytest.raises(parity.ParityError, match="nan"):
        gate.check("w", torch.tensor([[1.0, -2.0], [float("nan"), 4.0]]))


def test_a_fault_in_a_quiet_expert_is_not_hidden_by_a_busy_ones_rounding():
    """A stack of experts' gradients [E, out, in]: expert 0 summed many large terms (rounding
    1e-4), expert 1 few small ones (values 1e-6, rounding 1e-13). Expert 1's gradient doubled
    is off by 1e-6, far inside a bound taken over the whole tensor (16 × 1e-4) and far outside
    expert 1's own (16 × 1e-13 + 16 × 2^-24 × 2e-6)."""
    def per_expert(busy, quiet):
        return torch.cat([torch.full((1, 2, 3), busy, dtype=torch.float64),
                          torch.full((1, 2, 3), quiet, dtype=torch.float64)])

    ref64, error = per_expert(10.0, 1e-6), per_expert(1e-4, 1e-13)
    gate = parity.gate({"grad experts": ref64}, [{"grad experts": ref64 + error}])
    gate.check("grad experts", ref64 - error)  # another order, rounding as much the other way
    doubled = ref64.clone()
    doubled[1] *= 2
    with pytest.raises(parity.ParityError, match=r"grad experts\[1, 0, 0\] is 2e-06, the float64 reference 1e-06.*"
                                                 r"reference rounding 1e-13.*\(6 of 12 elements out\)"):
        gate.check("grad experts", doubled)


def test_reference_needs_an_optimizer_to_step():
    reference = parity.Reference(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="made without an optimizer"):
        reference.optimizer_step({})


def test_reference_gates_a_one_process_step_against_itself():
    """The float32 reference's own run passes its gate; its doubled gradient does not."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(32, 8)
    reference = parity.Reference(model)

    def step_fn(m, order):
        loss = m(x[order]).square().mean()
        loss.backward()
        return {"loss": loss}

    gate = reference.step(step_fn, rows=len(x))
    model.zero_grad()
    loss = step_fn(model, slice(None))["loss"]
    gate.check("loss", loss)
    grads = {f"grad {n}": p.grad for n, p in model.named_parameters()}
    gate.check_all(grads)
    with pytest.raises(parity.ParityError):
        gate.check("grad 0.weight", grads["grad 0.weight"] * 2)
