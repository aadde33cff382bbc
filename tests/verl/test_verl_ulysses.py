"""Our Ulysses context parallelism through verl: verl 0.9.1's `fsdp_turbo` engine with
`turbo_config.distributed.ulysses_parallel_size: 2` (our CP, `cp_plan` full_attention on the
eager attention) against verl's own `fsdp2` engine with its own Ulysses sequence parallelism
(`ulysses_sequence_parallel_size: 2`, which wraps Hugging Face's flash-attention path) and
against verl's `fsdp2` engine without sequence parallelism. Same harness, model, data and seed
as test_verl_engine.py: 4 gloo CPU ranks (ulysses 2 × ep 2 for ours), a tiny Qwen3-MoE, packed
rows (`use_remove_padding`), verl's SFT loss, 3 steps, fp32.

With sequence parallelism both ranks of a Ulysses group take their data rank's rows (4 per data
rank, the same global batch of 8 rows as the 4 data ranks of the run without it); verl pads the
packed micro-batch to a multiple of 2 and slices it before the model, and gathers the log-probs
after it. Compared: against verl's SP, per rank, the loss and grad norm verl reports, the
log-probs of `infer_batch` before each step and every weight after the last; against the run
without SP the global quantities (the loss summed over the data ranks / their number, the grad
norm, the log-probs of all rows in order, the weights).

verl's SP needs `flash_attn`: the ctest entry verl_ulysses puts the CPU stand-in of the
LlamaFactory tests (tests/llamafactory/site: flash_attn, and the sitecustomize that makes
transformers accept it on CPU) on PYTHONPATH; without it this file is skipped.
"""
import importlib.util
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "python")]
from verl_harness import (  # noqa: E402
    GRAD_NORM_RTOL, LOG_PROB_ATOL, LOSS_RTOL, ROWS_PER_RANK, STEPS, WORLD, Case, assert_weights_equal, build_engine,
    deviation, launch, train)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                                reason="verl's Ulysses SP needs flash_attn (tests/llamafactory/site on PYTHONPATH)")

SP = 2
CP_CASES = [Case(2, 1, "eager", False, ulysses=SP), Case(2, 1, "fused", True, ulysses=SP)]


def _rank_fn(rank, world, model_dir, batches, cases, out_path):
    import cpu_platform

    cpu_platform.install()
    from fsdp_turbo.distributed.parallel_state import reset_parallel_state

    data_rank, rows = rank // SP, ROWS_PER_RANK * SP
    results = {"fsdp2": train(build_engine("fsdp2", model_dir), batches, rank),
               "fsdp2_sp": train(build_engine("fsdp2", model_dir, attn_implementation="flash_attention_2", sp=SP),
                                 batches, data_rank, rows)}
    for case in cases:
        results[case.name] = train(build_engine("fsdp_turbo", model_dir, case), batches, data_rank, rows)
        reset_parallel_state()
    torch.save(results, f"{out_path}.{rank}")


@pytest.fixture(scope="module")
def runs():
    return launch(_rank_fn, CP_CASES)


def _global(runs, name, sp):
    """Per step: the global loss (the data ranks' losses summed / their number), the grad norm of
    rank 0, all rows' log-probs in global order; the weights of rank 0."""
    data_ranks = range(0, WORLD, sp)
    loss = [sum(runs[r][name]["loss"][s] for r in data_ranks) / len(data_ranks) for s in range(STEPS)]
    log_probs = [[t for r in data_ranks for t in runs[r][name]["log_probs"][s]] for s in range(STEPS)]
    return loss, runs[0][name]["grad_norm"], log_probs, runs[0][name]["weights"]


@pytest.mark.parametrize("case", CP_CASES, ids=lambda case: case.name)
def test_turbo_cp_equals_verl_ulysses_sp(runs, case):
    """Per rank and step, our CP through verl's turbo engine equals verl's own Ulysses SP on the
    fsdp2 engine within the bounds of verl_harness.py (float32 reordering)."""
    for rank, results in enumerate(runs):
        ours, reference = results[case.name], results["fsdp2_sp"]
        where = f"{case.name} rank {rank}"
        for step in range(STEPS):
            assert ours["loss"][step] == pytest.approx(reference["loss"][step], rel=LOSS_RTOL), f"{where} step {step}"
            if reference["grad_norm"][step] is None:  # verl reports it on each Ulysses group's first rank
                assert ours["grad_norm"][step] is None, f"{where} step {step}"
            else:
                assert ours["grad_norm"][step] == pytest.approx(reference["grad_norm"][step], rel=GRAD_NORM_RTOL), \
                    f"{where} step {step}"
            assert deviation(ours["log_probs"][step], reference["log_probs"][step]) <= LOG_PROB_ATOL, \
                f"{where} step {step}"
        assert_weights_equal(ours["weights"], reference["weights"], where)


@pytest.mark.parametrize("name", [case.name for case in CP_CASES] + ["fsdp2_sp"])
def test_sequence_parallel_equals_fsdp2_without_it(runs, name):
    """Our CP (and verl's SP, the harness's check) against verl's fsdp2 engine on 4 data ranks:
    the global loss, the grad norm, every row's log-probs, the weights."""
    loss, grad_norm, log_probs, weights = _global(runs, name, SP)
    ref_loss, ref_grad_norm, ref_log_probs, ref_weights = _global(runs, "fsdp2", 1)
    for step in range(STEPS):
        assert loss[step] == pytest.approx(ref_loss[step], rel=LOSS_RTOL), f"{name} step {step}"
        assert grad_norm[step] == pytest.approx(ref_grad_norm[step], rel=GRAD_NORM_RTOL), f"{name} step {step}"
        assert deviation(log_probs[step], ref_log_probs[step]) <= LOG_PROB_ATOL, f"{name} step {step}"
    assert_weights_equal(weights, ref_weights, name)
