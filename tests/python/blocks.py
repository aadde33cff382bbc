"""One Hugging Face MoE block under expert parallelism, shared by the EP tests: the block, its
per-rank data and forced routes, one step through it, and its parity gates against the block
run in one process."""
import torch

from fsdpturbo.ep import EPPlanConfig, expert_parallelize_modules

TOKENS_PER_RANK = 5


def moe_block(num_experts, top_k, dtype, seed=0, family="qwen3_moe"):
    """A Hugging Face sparse MoE block of `family` (hidden 16, expert intermediate 8), its weights
    drawn from N(0, 0.25) with `seed`."""
    torch.manual_seed(seed)
    if family == "qwen3_5_moe":  # with a shared expert and its gate, which stay local
        from transformers import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock as Block

        config = Qwen3_5MoeTextConfig(hidden_size=16, moe_intermediate_size=8, shared_expert_intermediate_size=12,
                                      num_experts=num_experts, num_experts_per_tok=top_k)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        config = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=num_experts,
                                num_experts_per_tok=top_k, norm_topk_prob=True)
    config._experts_implementation = "eager"  # HF's per-expert loop: the plainest reference
    block = Block(config).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return block


def block_data(world, dtype, seed=1):
    """`world` ranks' tokens (TOKENS_PER_RANK each) and the cotangent of the block's output."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * TOKENS_PER_RANK, 16, generator=g, dtype=torch.float64).to(dtype)
    cotangent = torch.randn(world * TOKENS_PER_RANK, 16, generator=g, dtype=torch.float64).to(dtype)
    return x, cotangent


def override_router(block, index_fn):
    """Replaces the router's choice by `index_fn(tokens)` (forced routes for edge cases),
    keeping differentiable weights from the router's probabilities."""
    gate = block.gate
    original = gate.forward

    def forward(hidden):
        logits, _, _ = original(hidden)
        index = index_fn(hidden.size(0)).to(hidden.device)
        probs = torch.softmax(logits.float(), -1).to(logits.dtype)
        return logits, probs.gather(1, index), index

    gate.forward = forward


def one_process_gates(dtype, inputs, routes, rank, seed=0):
    """The parity gates (fsdpturbo.parity: the block in one process in `dtype` and in float64) of
    an EP block (moe_block(8, 2), forced `routes` per rank or None) that ran on every rank's
    (x, cotangent) of `inputs` with the loss Σ out · cotangent: on this rank's tokens for its
    output, input gradient and the router's gradient (a router sees its own rank's tokens
    only), and on every rank's tokens together for the experts' gradients, of the mean over the
    ranks' losses (EP divides the experts' gradients by the world size)."""
    from fsdpturbo.parity import Reference

    def gate(ranks, divide):
        x = torch.cat([inputs[r][0] for r in ranks])
        cotangent = torch.cat([inputs[r][1] for r in ranks])
        block = moe_block(8, 2, dtype, seed=seed)
        rows_of = {}
        if routes[rank] is not None:
            ids = torch.cat([routes[r] for r in ranks])
            override_router(block, lambda tokens: ids[rows_of["order"]])

        def step_fn(model, order):
            rows_of["order"] = order
            rows = x[order].clone().requires_grad_(True)
            out = model(rows.unsqueeze(0)).squeeze(0)
            loss = (out * cotangent[order]).sum() / divide
            if loss.requires_grad:  # not on a rank without tokens (Hugging Face's block returns zeros)
                loss.backward()
            grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
            back = torch.argsort(order)  # the outputs in the rows' own order
            return {"output": out.detach()[back], "input grad": grad[back]}

        return Reference(block, dtype=dtype).step(step_fn, rows=len(x))

    return gate([rank], 1), gate(range(len(inputs)), len(inputs))


ROUTES = {
    "router": None,
    # Every token to experts 0 and 1: the other experts, and ranks holding them, receive nothing.
    "skewed": lambda t: torch.tensor([[0, 1]] * t),
    # Duplicate ids within one token's top-k.
    "duplicates": lambda t: torch.tensor([[i % 4, i % 4] for i in range(t)]),
}


def ep_block(mesh, dispatcher, capacity, dtype, route=None, rank=0, world=1, seed=0):
    """moe_block(8, 2) on `mesh`'s device under EP over `mesh` with `dispatcher` (and a
    `capacity`), the router forced to this rank's rows of `route` over every rank's tokens when
    given."""
    block = moe_block(8, 2, dtype, seed=seed).to(mesh.device_type)
    if route is not None:
        override_router(block, lambda t: route(world * TOKENS_PER_RANK)[rank * t:(rank + 1) * t])
    return expert_parallelize_modules(block, mesh, EPPlanConfig(apply_modules=["experts"], dispatcher=dispatcher,
                                                                capacity=capacity))


def ep_step(block, x, cotangent):
    """Output and gradients (input, router, local expert weights) of one forward and backward."""
    x = x.clone().requires_grad_(True)
    out = block(x.unsqueeze(0)).squeeze(0)
    (out * cotangent).sum().backward()
    return {"output": out.detach(), "input grad": x.grad, "grad gate.weight": block.gate.weight.grad,
            "grad experts.gate_up_proj": block.experts.gate_up_proj.grad.full_tensor(),
            "grad experts.down_proj": block.experts.down_proj.grad.full_tensor()}
