"""MoE benchmarks on CPU, each a ratio measured in one run (issue 4):
1. routing metadata (histogram + stable permutation + splits): the Rust counting sort
   (`torch.ops.fsdpturbo.moe_route`) vs the torch path the seed uses (histc + argsort), T=16384,
   K=8, E=128, P=8;
2. a Qwen3-MoE sparse block forward + backward in one process (ep 1): fused vs eager dispatcher;
3. the cost of the expert-load statistics (`fsdpturbo.moe.expert_stats.record`) in that block: the
   fused block with and without recording, rounds alternated.
Run: PYTHONPATH=torch_ext/python .venv/bin/python benches/moe.py
"""
import os
import statistics
import time

import torch
import torch.distributed as dist

from fsdpturbo.ep import EPPlanConfig, expert_parallelize_modules

ops = torch.ops.fsdpturbo


def median_seconds(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_routing(ids, num_experts, ep_size):
    flat = ids.reshape(-1)
    counts = torch.histc(flat.float(), bins=num_experts, min=0, max=num_experts).long()
    permutation = torch.argsort(flat.float(), stable=True)
    splits = counts.view(ep_size, -1).sum(1)
    return counts, permutation, splits


def routing(tokens=16384, top_k=8, num_experts=128, ep_size=8):
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)])
    ours = ops.moe_route(ids, num_experts, ep_size)
    reference = torch_routing(ids, num_experts, ep_size)
    assert all(torch.equal(a, b) for a, b in zip(ours, reference)), "routing differs from the torch path"
    t_ours = median_seconds(lambda: ops.moe_route(ids, num_experts, ep_size), 21)
    t_torch = median_seconds(lambda: torch_routing(ids, num_experts, ep_size), 21)
    print(f"routing T={tokens} K={top_k} E={num_experts} P={ep_size}: ours {t_ours * 1e3:.2f} ms, "
          f"torch histc+argsort {t_torch * 1e3:.2f} ms, ratio {t_torch / t_ours:.1f}x")


def block_step(dispatcher, dtype, tokens=2048, hidden=512, inter=256, experts=16, top_k=4, *, capacity=None,
               compiled=False, device="cpu", trained=True, lora_rank=0):
    """One forward + backward of a Qwen3-MoE sparse block under `dispatcher` (ep 1), its weights
    drawn from N(0, 0.02) (Hugging Face leaves them uninitialised: zeros here, which would send
    every token to the same experts); with a `Capacity`, the capacity-bounded dispatch;
    `compiled`: under torch.compile (inductor); not `trained`: the block's weights frozen (the
    input's gradient still computed); `lora_rank`: PEFT's LoRA of that rank on both expert
    weights (fsdpturbo.moe.expert_lora), its factors from N(0, 0.02) too. `step(set_to_none=False)`
    keeps the gradient buffers (CUDA-graph capture)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                            num_experts_per_tok=top_k)
    config._experts_implementation = "eager"
    moe = Qwen3MoeSparseMoeBlock(config).to(device=device, dtype=dtype)
    moe.requires_grad_(trained)
    if lora_rank:
        from peft import LoraConfig, inject_adapter_in_model

        inject_adapter_in_model(LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                                           target_parameters=["experts.gate_up_proj", "experts.down_proj"]), moe)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.02)
    mesh = torch.distributed.device_mesh.init_device_mesh(device, (1,), mesh_dim_names=("ep",))
    expert_parallelize_modules(moe, mesh["ep"], EPPlanConfig(apply_modules=["experts"], dispatcher=dispatcher,
                                                             capacity=capacity))
    run = torch.compile(moe) if compiled else moe
    x = torch.randn(1, tokens, hidden, dtype=dtype, device=device, requires_grad=True)

    def step(set_to_none=True):
        moe.zero_grad(set_to_none=set_to_none)
        run(x).sum().backward()

    return step


def block(dispatcher, dtype):
    return median_seconds(block_step(dispatcher, dtype), 7)


def expert_load_cost(calls=2000):
    """What recording adds to one fused fp32 block forward + backward: the pipeline's statistics
    call (this rank's row of the gathered counts summed over slices, added to the module's
    tally) timed alone over `calls` calls, against the block's median time. (An A/B of whole
    blocks cannot resolve it: the blocks' run-to-run noise is larger than the call.)"""
    from fsdpturbo.moe import ep_state, expert_stats

    step = block_step("fused", torch.float32)
    block_seconds = median_seconds(step, 7)
    module = torch.nn.Module()
    ep_state.attach(module, ep_state.EPModuleState(name="experts", num_global_experts=16, num_local_experts=16,
                                                   ep_rank=0, dispatcher=None, gradient_reduction=None))
    gathered = torch.randint(0, 512, (1, 1, 17))

    def record_many():
        for _ in range(calls):
            expert_stats.record(module, gathered[0, :, :16].sum(0))

    per_call = median_seconds(record_many, 5) / calls
    print(f"expert-load statistics: {per_call * 1e6:.1f} us per MoE layer call, fused fp32 block fwd+bwd "
          f"{block_seconds * 1e3:.1f} ms: cost {100 * per_call / block_seconds:.4f} %")


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    routing()
    for dtype in (torch.float32, torch.bfloat16):
        eager, fused = block("eager", dtype), block("fused", dtype)
        print(f"MoE block fwd+bwd {str(dtype)[6:]} (2048 tokens, H=512, I=256, 16 experts, top-4): "
              f"eager {eager * 1e3:.1f} ms, fused {fused * 1e3:.1f} ms, fused/eager speed-up {eager / fused:.2f}x")
    expert_load_cost()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
