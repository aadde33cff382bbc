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
checkpointing (verl's default), once HSDP (fully-shard 2 × data 2), once with verl's CPU
offload policy); the parallel state is reset between cases. The first case also builds a
forward-only reference engine before its actor, both on one parallel state, as verl's PPO
workers do; its log-probs are compared with the fsdp2 engine's first ones.

The harness (`cpu_platform`: a CPU platform for verl registered through its plugin registry)
lives here; verl's code is not edited. Run by ctest (`ctest -L verl`) in the environment
scripts/setup.sh builds: PYTHONPATH = .venv/verl : .venv/transformers-5.8 : torch_ext/python.
"""
import dataclasses
import os
import sys
import tempfile

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "python")]
from dist_util import run_ranks  # noqa: E402

WORLD, STEPS, ROWS_PER_RANK, LR = 4, 3, 2, 1e-3
LAUNCH_TIMEOUT_S = 600
# Different reduction orders (all-to-all expert compute, EFSDP reduce-scatter, our norm) in fp32:
# a few float32 roundings, far below what a wrong divide factor or a missing reduction gives.
LOSS_RTOL, GRAD_NORM_RTOL, LOG_PROB_ATOL, WEIGHT_ATOL = 1e-5, 1e-5, 1e-5, 1e-6
# Our Ulysses CP (ulysses_parallel_size > 1): the eager attention over the whole sequence after an
# all-to-all; verl slices the packed rows before the model and computes its loss from the gathered
# log-probs, so no loss patch.
CP_PLAN = {"ulysses_function_patches": [{
    "target_functions": ["transformers.models.qwen3_moe.modeling_qwen3_moe.eager_attention_forward"],
    "type": "full_attention"}]}


@dataclasses.dataclass(frozen=True)
class Case:
    ep: int
    efsdp: int
    dispatcher: str
    recompute: bool  # FSDPTurbo's memory.recompute
    hf_checkpointing: bool = False  # verl's model.enable_gradient_checkpointing (its default: on)
    fsdp: int = WORLD  # distributed.fully_shard_parallel_size: below the world, HSDP
    offload: bool = False  # verl's engine.offload_policy, which it copies into fsdp_plan.cpu_offload
    ulysses: int = 1  # distributed.ulysses_parallel_size: from 2, our Ulysses CP (cp_plan below)

    @property
    def name(self):
        recompute = "recompute" if self.recompute else "no_recompute"
        extras = {"hf_ckpt": self.hf_checkpointing, "hsdp": self.fsdp != WORLD, "offload": self.offload,
                  f"cp{self.ulysses}": self.ulysses > 1}
        return "_".join([f"ep{self.ep}_efsdp{self.efsdp}_{self.dispatcher}_{recompute}"] + [k for k, v in extras.items() if v])

    def turbo_config(self):
        """verl's `engine.turbo_config` for this case, as its GPU recipes write it, with fp32 dtypes
        and the fully-shard size of this world."""
        return {
            "distributed": {
                "fully_shard_parallel_size": self.fsdp,
                "tensor_parallel_size": 1,
                "expert_parallel_size": self.ep,
                "expert_fully_shard_parallel_size": self.efsdp,
                "ulysses_parallel_size": self.ulysses,
                "fsdp_plan": {"apply_modules": {"model.layers.{*}": {}, "model.embed_tokens": {}, "lm_head": {}},
                              "param_dtype": "fp32", "reduce_dtype": "fp32", "output_dtype": "fp32",
                              "fsdp_implementation": "native", "num_to_forward_prefetch": 1,
                              "num_to_backward_prefetch": 1, "pin_memory": False},  # pinning needs CUDA
                "ep_plan": {"apply_modules": ["model.layers.{*}.mlp.experts"], "dispatcher": self.dispatcher},
                **({"cp_plan": CP_PLAN} if self.ulysses > 1 else {}),
            },
            "memory": {"recompute": self.recompute, "recompute_plan": ["model.layers.{*}"]},
        }


CASES = [Case(2, 2, "eager", False), Case(2, 2, "fused", True, fsdp=2), Case(4, 1, "eager", True, hf_checkpointing=True),
         Case(4, 1, "fused", False, offload=True)]


def save_tiny_model(path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(config).save_pretrained(path)


def global_batches():
    """Per step, the global batch: ROWS_PER_RANK sequences per rank of lengths 5 to 11, the
    loss on each sequence's second half."""
    g = torch.Generator().manual_seed(7)
    steps = []
    for _ in range(STEPS):
        lengths = torch.randint(5, 12, (WORLD * ROWS_PER_RANK,), generator=g).tolist()
        ids = [torch.randint(0, 64, (n,), generator=g) for n in lengths]
        masks = [(torch.arange(n) >= n // 2).long() for n in lengths]
        steps.append((ids, masks))
    return steps


def rank_batch(step_batch, rank, rows_per_rank=ROWS_PER_RANK):
    """The rows of data rank `rank` of a global batch as verl's no-padding TensorDict."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    ids, masks = (rows[rank * rows_per_rank:(rank + 1) * rows_per_rank] for rows in step_batch)
    jagged = lambda rows: torch.nested.as_nested_tensor(rows, layout=torch.jagged)  # noqa: E731
    data = TensorDict({"input_ids": jagged(ids), "position_ids": jagged([torch.arange(len(r)) for r in ids]),
                       "loss_mask": jagged(masks)}, batch_size=[len(ids)])
    for key, value in {"use_remove_padding": True, "use_dynamic_bsz": False, "micro_batch_size_per_gpu": 1,
                       "temperature": 1.0}.items():
        tu.assign_non_tensor(data, **{key: value})
    return data


def build_engine(strategy, model_dir, case=None, forward_only=False, attn_implementation="eager", sp=1):
    """verl's engine of `strategy`; `sp` is verl's own ulysses_sequence_parallel_size."""
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.fsdp_turbo_impl import FSDPTurboEngineWithLMHead
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model_config = HFModelConfig(path=model_dir, load_tokenizer=False, override_config={"attn_implementation": attn_implementation},
                                 enable_gradient_checkpointing=bool(case and case.hf_checkpointing))
    engine_config = FSDPEngineConfig(strategy=strategy, use_torch_compile=False, fsdp_size=-1,
                                     ulysses_sequence_parallel_size=sp,
                                     mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                      "buffer_dtype": "fp32"},
                                     offload_policy=bool(case and case.offload), forward_only=forward_only,
                                     turbo_config=case.turbo_config() if case else {})
    optimizer_config = FSDPOptimizerConfig(lr=LR, clip_grad=1.0, total_training_steps=STEPS)
    engine_cls = FSDPTurboEngineWithLMHead if strategy == "fsdp_turbo" else FSDPEngineWithLMHead
    engine = engine_cls(model_config, engine_config, optimizer_config, checkpoint_config=None)
    engine._autocast_dtype = torch.float32  # verl's turbo engine keeps __init__'s bf16 whatever the plan says
    engine.initialize()
    return engine


def log_probs_of(engine, step_batch, rank, rows_per_rank=ROWS_PER_RANK):
    with engine.eval_mode():
        out = engine.infer_batch(rank_batch(step_batch, rank, rows_per_rank))
    return [t.clone() for t in out["model_output"]["log_probs"].unbind()]


def train(engine, batches, rank, rows_per_rank=ROWS_PER_RANK):
    """Per step: the log-probs of a forward-only pass, then one training step's loss and grad
    norm, on data rank `rank`'s rows. At the end: every weight, full."""
    from functools import partial

    from verl.workers.utils.losses import sft_loss

    log_probs, losses, grad_norms = [], [], []
    for step_batch in batches:
        log_probs.append(log_probs_of(engine, step_batch, rank, rows_per_rank))
        with engine.train_mode():
            out = engine.train_batch(rank_batch(step_batch, rank, rows_per_rank), partial(sft_loss, config=None))
        engine.lr_scheduler_step()
        losses.append(sum(out["loss"]))
        grad_norms.append(out["metrics"].get("grad_norm"))  # with SP only on each group's first rank
    params, _ = engine.get_per_tensor_param()
    weights = {name: tensor.detach().clone() for name, tensor in params}
    return {"log_probs": log_probs, "loss": losses, "grad_norm": grad_norms, "weights": weights}


def _rank_fn(rank, world, model_dir, batches, cases, out_path):
    import cpu_platform

    cpu_platform.install()
    from fsdp_turbo.distributed.parallel_state import reset_parallel_state

    results = {"fsdp2": train(build_engine("fsdp2", model_dir), batches, rank)}
    for i, case in enumerate(cases):
        # The first case also builds a forward-only reference engine before the actor, in the same
        # process and parallel state, as verl's PPO workers do.
        ref = build_engine("fsdp_turbo", model_dir, case, forward_only=True) if i == 0 else None
        results[case.name] = train(build_engine("fsdp_turbo", model_dir, case), batches, rank)
        if ref is not None:
            results[case.name]["ref_log_probs"] = log_probs_of(ref, batches[0], rank)
        reset_parallel_state()
    torch.save(results, f"{out_path}.{rank}")


def launch(rank_fn, cases):
    """Saves the tiny model, runs rank_fn(rank, world, model_dir, batches, cases, out_path) on
    WORLD ranks and returns each rank's saved results."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        save_tiny_model(model_dir)
        out = os.path.join(tmp, "results")
        run_ranks(rank_fn, WORLD, model_dir, global_batches(), cases, out, timeout=LAUNCH_TIMEOUT_S)
        return [torch.load(f"{out}.{rank}") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def runs():
    return launch(_rank_fn, CASES)


def _deviation(ours, reference):
    return max((a - b).abs().max().item() for a, b in zip(ours, reference))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_turbo_engine_equals_fsdp2_engine(runs, case):
    """Per rank and step: the loss and grad norm verl reports and the log-probs of its forward,
    then every final weight, equal verl's fsdp2 engine's within float32 reordering."""
    for rank, results in enumerate(runs):
        ours, reference = results[case.name], results["fsdp2"]
        where = f"{case.name} rank {rank}"
        for step in range(STEPS):
            assert ours["loss"][step] == pytest.approx(reference["loss"][step], rel=LOSS_RTOL), f"{where} step {step}"
            assert ours["grad_norm"][step] == pytest.approx(reference["grad_norm"][step], rel=GRAD_NORM_RTOL), \
                f"{where} step {step}"
            assert _deviation(ours["log_probs"][step], reference["log_probs"][step]) <= LOG_PROB_ATOL, \
                f"{where} step {step}"
        if case == CASES[0]:  # the forward-only engine beside the actor: the initial weights
            assert _deviation(ours["ref_log_probs"], reference["log_probs"][0]) <= LOG_PROB_ATOL, where
        assert ours["weights"].keys() == reference["weights"].keys()
        for name, weight in reference["weights"].items():
            assert ours["weights"][name].shape == weight.shape, f"{where} {name}"
            assert (ours["weights"][name] - weight).abs().max().item() <= WEIGHT_ATOL, f"{where} {name}"
