"""Tiny Hugging Face MoE models (Qwen3-MoE, Qwen3.5-MoE, built in code: nothing downloaded),
their training configurations, batches and layouts, shared by the tests."""
import torch

SEQ = 6
STEPS = 3  # optimizer steps of a training test
LR = 1e-3  # AdamW normalises each element: near-zero gradients turn tiny rounding differences into lr-sized steps


def tiny_config(family):
    """A tiny config of `family` built in code (nothing downloaded)."""
    if family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig

        config = Qwen3_5MoeTextConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=2,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=12,
            tie_word_embeddings=False)
    else:
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)
    return config


def build_model(family, seed=0, config=None):
    """The Hugging Face causal LM of `family` (its `tiny_config` unless `config` is given),
    initialised from `seed` (the same on every rank). The text-only Qwen3.5 model's type is
    qwen3_5_moe_text, a built-in spec."""
    torch.manual_seed(seed)
    if family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM as Model
    else:
        from transformers import Qwen3MoeForCausalLM as Model
    return Model(config or tiny_config(family))


def batch(step, world):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (world, SEQ), generator=g)


def train_config(ep, efsdp=None, cp=1, bf16=False, ignored=(), dispatcher="eager", capacity_factor=None):
    dist_config = {"name": "fsdpturbo", "ep_size": ep, "ep_dispatcher": dispatcher,
                   "fsdp_ignored_modules": list(ignored)}
    if efsdp is not None:
        dist_config["efsdp_size"] = efsdp
    if capacity_factor is not None:
        dist_config["capacity_factor"] = capacity_factor
    return {"bf16": bf16, "cp_size": cp, "dist_config": dist_config}


def full(t):
    from torch.distributed.tensor import DTensor

    from fsdpturbo import gather_full

    return gather_full(t) if isinstance(t, DTensor) else t.detach()


def layout_state(world, ep, efsdp, cp):
    import fsdpturbo

    return fsdpturbo.ParallelState(world, cp_size=cp, ep_size=ep, efsdp_size=efsdp).init_device_meshes("cpu")


def positions(family, rows, length):
    """Position ids of `rows` sequences of `length` tokens: for Qwen3.5 multi-axis mRoPE ids
    [3, rows, length] whose temporal, height and width axes differ (as over an image's tokens),
    else the plain [rows, length]."""
    t = torch.arange(length)
    ids = torch.stack([t, t // 2, t % 3]) if family == "qwen3_5_moe" else t[None]
    return ids[:, None].expand(-1, rows, -1).squeeze(0)


def loss_and_norm_step(ids, position_ids=None):
    """The one-process reference's step on the batch `ids` (and `position_ids`, whose last dim
    is the sequence): forward and backward, returning the loss and the gradients' total norm
    (gradients left unclipped)."""

    def step_fn(model, order):
        kwargs = {} if position_ids is None else {"position_ids": position_ids}  # the same for every row
        loss = model(input_ids=ids[order], labels=ids[order], **kwargs).loss
        loss.backward()
        return {"loss": loss, "grad norm": torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])}

    return step_fn


def rank_loss(model, state, family, ids):
    """The rank's loss on the global batch `ids` [dp, cp · SEQ]: its data-parallel rank's
    sequence, split over its CP group (Ulysses, `ulysses`) when cp > 1."""
    import ulysses

    row = ids[state.sub_mesh("dp").get_local_rank()][None]
    if state.cp_size == 1:
        return model(input_ids=row, labels=row).loss
    group = state.sub_mesh("cp").get_group()
    position_ids = ulysses.chunk(positions(family, 1, row.shape[1]), group)
    logits = model(input_ids=ulysses.chunk(row, group), position_ids=position_ids).logits
    return ulysses.causal_lm_loss(logits, ulysses.shifted_labels(row), group)
