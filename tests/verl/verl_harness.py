"""What the verl tests share (test_verl_engine.py, test_verl_ulysses.py): the tiny model, the
global batches, verl's engines built for a case, a training run through verl's own
`train_batch`, the launch on WORLD gloo ranks, and the bounds the comparisons use."""
import dataclasses
import os
import tempfile

import torch

from dist_util import run_ranks

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
    lora: bool = False  # verl's LoRA (LORA below): adapters on attention and on the experts

    @property
    def name(self):
        recompute = "recompute" if self.recompute else "no_recompute"
        extras = {"hf_ckpt": self.hf_checkpointing, "hsdp": self.fsdp != WORLD, "offload": self.offload,
                  f"cp{self.ulysses}": self.ulysses > 1, "lora": self.lora}
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


# verl's LoRA (actor_rollout_ref.model.lora_rank > 0): adapters on attention and on the experts.
LORA = {"lora_rank": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def build_engine(strategy, model_dir, case=None, forward_only=False, attn_implementation="eager", sp=1, lora=False):
    """verl's engine of `strategy`; `sp` is verl's own ulysses_sequence_parallel_size; `lora` (or
    the case's): verl wraps the model with PEFT (LORA) before handing it to the engine's sharding."""
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.fsdp_turbo_impl import FSDPTurboEngineWithLMHead
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    lora = lora or bool(case and case.lora)
    if lora:
        torch.manual_seed(0)  # PEFT draws lora_A on rank 0 (broadcast by verl's load): the same for every engine
    model_config = HFModelConfig(path=model_dir, load_tokenizer=False, override_config={"attn_implementation": attn_implementation},
                                 enable_gradient_checkpointing=bool(case and case.hf_checkpointing),
                                 **(LORA if lora else {}))
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
    params, _ = engine.get_per_tensor_param()  # with LoRA: the base weights
    weights = {name: tensor.detach().clone() for name, tensor in params}
    return {"log_probs": log_probs, "loss": losses, "grad_norm": grad_norms, "weights": weights,
            "adapters": adapters_of(engine.module)}


def adapters_of(model):
    """The LoRA factors of `model` (a sharded PEFT model, or any other: {}), full, by PEFT's names
    and in its layout (fsdpturbo.moe.expert_lora.to_peft: the experts' factors taken over by our
    engine back in PEFT's folded matrices)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fsdpturbo.moe import expert_lora

    if not hasattr(model, "peft_config"):  # no adapters: nothing to gather
        return {}
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: value for name, value in expert_lora.to_peft(model, state).items() if ".lora_" in name}


def launch(rank_fn, cases):
    """Saves the tiny model, runs rank_fn(rank, world, model_dir, batches, cases, out_path) on
    WORLD ranks and returns each rank's saved results."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        save_tiny_model(model_dir)
        out = os.path.join(tmp, "results")
        run_ranks(rank_fn, WORLD, model_dir, global_batches(), cases, out, timeout=LAUNCH_TIMEOUT_S)
        return [torch.load(f"{out}.{rank}") for rank in range(WORLD)]


def deviation(ours, reference):
    """The largest |difference| between two equally long lists of tensors of equal shapes."""
    assert len(ours) == len(reference), f"{len(ours)} tensors against {len(reference)}"
    for a, b in zip(ours, reference):
        assert a.shape == b.shape, f"shape {tuple(a.shape)} against {tuple(b.shape)}"
    return max((a - b).abs().max().item() for a, b in zip(ours, reference))


def assert_weights_equal(ours, reference, where):
    assert ours.keys() == reference.keys(), where
    for key, weight in reference.items():
        assert ours[key].shape == weight.shape, f"{where} {key}"
        assert (ours[key] - weight).abs().max().item() <= WEIGHT_ATOL, f"{where} {key}"
