"""The demo's parity check (examples/train.py, `check_parity`) has teeth: fed the steps of a
correct run it prints PARITY; fed the same steps with one fault a broken engine would make — a
missing reduction (a dense gradient holding one rank's half), a wrong divide factor (every
expert gradient doubled), a doubled gradient of one quiet expert — it prints MISMATCH naming
the tensor and returns False, which the demo turns into exit status 1. The run here is the
one-process computation itself (no ranks needed): what is tested is the gate, not the engine."""
import argparse
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import train as demo  # noqa: E402

WORLD = 2  # the global batch is WORLD × batch rows, as on that many ranks
EXPERTS = "model.layers.1.mlp.experts.down_proj"


def _args():
    return argparse.Namespace(model="qwen3_moe", size="tiny", steps=2, batch=2, seq=16, lr=1e-3, max_norm=1.0)


def _correct_run(args):
    """The steps as one process takes them: (history, records, final parameters) in the shapes
    `check_parity` reads from a sharded run."""
    model = demo.build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    history, records = [], []
    for step in range(args.steps):
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        tokens = demo.global_batch(args, step, WORLD, model.config.vocab_size)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        records.append((start, {n: p.grad.detach().clone() for n, p in model.named_parameters()}))
        history.append((loss.item(), norm.item(), 0.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return history, records, {n: p.detach().clone() for n, p in model.named_parameters()}


def _quietest_expert(grad):
    """The expert with the smallest gradient that is not zero (one that got tokens)."""
    size = grad.flatten(1).abs().amax(1)
    return int(torch.where(size > 0, size, torch.inf).argmin())


def _missing_reduction(grads):
    grads["model.embed_tokens.weight"] = grads["model.embed_tokens.weight"] / 2


def _wrong_divide_factor(grads):
    for name in grads:
        if ".mlp.experts." in name:
            grads[name] = grads[name] * 2


def _one_quiet_expert_doubled(grads):
    grad = grads[EXPERTS].clone()
    grad[_quietest_expert(grad)] *= 2
    grads[EXPERTS] = grad


@pytest.fixture(scope="module")
def run():
    return _correct_run(_args())


def test_a_correct_run_passes(run, capsys):
    history, records, params = run
    assert demo.check_parity(_args(), history, records, params, WORLD)
    assert "PARITY: the sharded run equals the one-process run" in capsys.readouterr().out


@pytest.mark.parametrize("fault,tensor", [(_missing_reduction, "model.embed_tokens.weight"),
                                          (_wrong_divide_factor, ".mlp.experts."),
                                          (_one_quiet_expert_doubled, EXPERTS)])
def test_a_fault_fails_naming_the_tensor(run, capsys, fault, tensor):
    history, records, params = run
    faulty = []
    for start, grads in records:
        grads = dict(grads)
        fault(grads)
        faulty.append((start, grads))
    assert not demo.check_parity(_args(), history, faulty, params, WORLD)
    out = capsys.readouterr().out
    assert "MISMATCH: the sharded run differs from the one-process run" in out
    gradients = next(line for line in out.splitlines() if line.lstrip().startswith("gradients: "))
    assert tensor in gradients.split(" is ")[0] and "> bound" in gradients, gradients
