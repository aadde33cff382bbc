"""verl's own engine as the oracle: verl 0.9.1 (from PyPI, unmodified) drives its
`FSDPTurboEngineWithLMHead` (`strategy=fsdp_turbo`) on our `fsdp_turbo` package and, on the
same model, data and seed, its `FSDPEngineWithLMHead` (`strategy=fsdp2`, plain FSDP2 over the
world). Compared per step: the SFT loss verl reports, the grad norm it reports, the log-probs
of verl's forward-only pass (`infer_batch`) before each step; at the end every weight
(`get_per_tensor_param`, gathered).

4 gloo CPU ranks, a tiny random Qwen3-MoE saved offline with `save_pretrained`, 3 steps of 2
micro-batches per rank (verl's gradient accumulation), fp32 (the harness sets the turbo
engine's autocast dtype, which verl leaves at bf16), packed sequences (`use_remove_padding`).
One launch runs the fsdp2 reference once and then every turbo case (EP 2 × EFSDP 2 and EP 4,
eager and fused, FSDPTurbo's recompute on and off, once beside verl's own gradient
checkpointing (verl's default) and once alone at EP 4, once HSDP (fully-shard 2 × data 2), once
with verl's CPU offload policy, once with verl's LoRA on attention and on the experts (`lora_rank`,
`target_modules`, `target_parameters`) against verl's fsdp2 engine with the same LoRA: there also
every adapter, gathered in PEFT's names and layout); the parallel state is reset between cases. The first case also builds a
forward-only reference engine before its actor, both on one parallel state, as verl's PPO
workers do; its log-probs are compared with the fsdp2 engine's first ones.

The harness (`cpu_platform`: a CPU platform for verl registered through its plugin registry)
lives here; verl's code is not edited. Run by ctest (`ctest -L verl`) in the environment
scripts/setup.sh builds: PYTHONPATH = .venv/verl : .venv/transformers-5.8 : torch_ext/python.
"""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "python")]
from verl_harness import (  # noqa: E402
    GRAD_NORM_RTOL, LOG_PROB_ATOL, LOSS_RTOL, STEPS, Case, assert_weights_equal, build_engine, deviation, launch,
    log_probs_of, train)

# Every (layout, dispatcher, recompute) combination, and beside them HSDP, verl's own gradient
# checkpointing, CPU offload and verl's LoRA.
CASES = [Case(2, 2, "eager", False), Case(2, 2, "eager", True), Case(2, 2, "fused", False),
         Case(2, 2, "fused", True, fsdp=2), Case(4, 1, "eager", False), Case(4, 1, "eager", True),
         Case(4, 1, "fused", False, offload=True), Case(4, 1, "fused", True), Case(4, 1, "eager", True, hf_checkpointing=True),
         Case(2, 2, "eager", True, lora=True)]


def _rank_fn(rank, world, model_dir, batches, cases, out_path):
    import cpu_platform

    cpu_platform.install()
    from fsdp_turbo.distributed.parallel_state import reset_parallel_state

    results = {"fsdp2": train(build_engine("fsdp2", model_dir), batches, rank),
               "fsdp2_lora": train(build_engine("fsdp2", model_dir, lora=True), batches, rank)}
    for i, case in enumerate(cases):
        # The first case also builds a forward-only reference engine before the actor, in the same
        # process and parallel state, as verl's PPO workers do.
        ref = build_engine("fsdp_turbo", model_dir, case, forward_only=True) if i == 0 else None
        results[case.name] = train(build_engine("fsdp_turbo", model_dir, case), batches, rank)
        if ref is not None:
            results[case.name]["ref_log_probs"] = log_probs_of(ref, batches[0], rank)
        reset_parallel_state()
    torch.save(results, f"{out_path}.{rank}")


@pytest.fixture(scope="module")
def runs():
    return launch(_rank_fn, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_turbo_engine_equals_fsdp2_engine(runs, case):
    """Per rank and step: the loss and grad norm verl reports and the log-probs of its forward,
    then every final weight, equal verl's fsdp2 engine's within float32 reordering."""
    for rank, results in enumerate(runs):
        ours, reference = results[case.name], results["fsdp2_lora" if case.lora else "fsdp2"]
        where = f"{case.name} rank {rank}"
        for step in range(STEPS):
            assert ours["loss"][step] == pytest.approx(reference["loss"][step], rel=LOSS_RTOL), f"{where} step {step}"
            assert ours["grad_norm"][step] == pytest.approx(reference["grad_norm"][step], rel=GRAD_NORM_RTOL), \
                f"{where} step {step}"
            assert deviation(ours["log_probs"][step], reference["log_probs"][step]) <= LOG_PROB_ATOL, \
                f"{where} step {step}"
        if case == CASES[0]:  # the forward-only engine beside the actor: the initial weights
            assert deviation(ours["ref_log_probs"], reference["log_probs"][0]) <= LOG_PROB_ATOL, where
        assert_weights_equal(ours["weights"], reference["weights"], where)
        assert_weights_equal(ours["adapters"], reference["adapters"], where)
        if case.lora:  # the experts' adapters trained (PEFT starts lora_B at zero)
            experts = [n for n in ours["adapters"] if ".mlp.experts." in n and ".lora_B." in n]
            assert len(experts) == 4 and all(ours["adapters"][n].abs().max() > 0 for n in experts), where
