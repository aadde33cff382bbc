"""Trains a randomly initialised Hugging Face Qwen3-MoE (or Qwen3.5-MoE) with EP × EFSDP × outer
FSDP2 on CPU gloo ranks, then checks it against the same steps run in one process, then times
the dispatchers. Launch with torchrun (scripts/demo.sh does):

    torchrun --standalone --nproc-per-node 4 examples/train.py --ep 2 --efsdp 2 --dispatcher eager

Every rank builds the same model from the same seed (nothing is downloaded) and trains on its own
slice of a synthetic global batch; the loss is the mean over the global batch, so the sharded run
and the one-process run compute the same numbers up to rounding.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

SIZES = {  # hidden, layers, experts, top-k, expert intermediate, vocab
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=16, vocab_size=128),
    "small": dict(hidden_size=128, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4,
                  moe_intermediate_size=64, vocab_size=1024),
    "medium": dict(hidden_size=256, num_hidden_layers=4, num_experts=32, num_experts_per_tok=8,
                   moe_intermediate_size=128, vocab_size=4096),
}
DISPATCHERS = ("eager", "fused", "domino")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("qwen3_moe", "qwen3_5_moe"), default="qwen3_moe")
    p.add_argument("--size", choices=tuple(SIZES), default="small")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size")
    p.add_argument("--efsdp", type=int, default=None,
                   help="expert-FSDP size (default: the seed's formula, dp / ep)")
    p.add_argument("--dispatcher", choices=DISPATCHERS, default="eager")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--no-reference", action="store_true", help="skip the one-process comparison")
    p.add_argument("--no-compare", action="store_true", help="skip the dispatcher table")
    p.add_argument("--compare-steps", type=int, default=3, help="timed steps per dispatcher in the table")
    p.add_argument("--baseline", action="store_true",
                   help="add plain FSDP2 without EP (experts replicated) to the dispatcher table")
    return p.parse_args()


def model_config(args):
    size = dict(SIZES[args.size])
    common = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=size["hidden_size"] // 4,
                  tie_word_embeddings=False)
    if args.model == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig

        layers = size["num_hidden_layers"]
        config = Qwen3_5MoeTextConfig(
            **size, **common, shared_expert_intermediate_size=size["moe_intermediate_size"],
            layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=2)
    else:
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(**size, **common, intermediate_size=2 * size["moe_intermediate_size"],
                                norm_topk_prob=True)
    config._experts_implementation = "eager"  # the one-process reference: HF's per-expert loop
    return config


def build_model(args):
    """The same randomly initialised model on every rank (same seed)."""
    torch.manual_seed(0)
    if args.model == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM as Model
    else:
        from transformers import Qwen3MoeForCausalLM as Model
    return Model(model_config(args))


def global_batch(args, step, world, vocab):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (world * args.batch, args.seq), generator=g)


def train_config(args, dispatcher):
    dist_config = {"name": "fsdpturbo", "ep_size": args.ep, "ep_dispatcher": dispatcher}
    if args.efsdp is not None:
        dist_config["efsdp_size"] = args.efsdp
    return {"bf16": False, "dist_config": dist_config}


def full(tensor):
    from torch.distributed.tensor import DTensor

    from fsdpturbo import gather_full

    return gather_full(tensor) if isinstance(tensor, DTensor) else tensor.detach().clone()


def gathered(model, attr=None):
    """Every parameter (or its `.grad`) gathered to a full tensor: a collective on every rank."""
    return {n: full(getattr(p, attr) if attr else p) for n, p in model.named_parameters()}


def train_steps(args, model, steps, clip, record=False, show=False):
    """Trains `steps` steps on this rank's slice of each global batch; returns per-step (global
    mean loss, grad norm, seconds) and, with `record`, per step the gathered parameters it
    started from and its gathered (clipped) gradients (rank 0 keeps them). `show`: rank 0
    prints each step as it ends."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    history, records = [], []
    for step in range(steps):
        tokens = global_batch(args, step, world, model.config.vocab_size)[rank * args.batch:(rank + 1) * args.batch]
        start_params = gathered(model) if record else None
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        norm = clip(model, args.max_norm)
        if record:
            grads = gathered(model, "grad")
            if rank == 0:
                records.append((start_params, grads))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        history.append((mean_loss.item() / world, float(norm), seconds))
        if show and rank == 0:
            print(f"  {step:>4}{history[-1][0]:>11.5f}{history[-1][1]:>12.5f}"
                  f"{world * args.batch * args.seq / seconds:>11.0f}", flush=True)
    return history, records


def sharded_run(args, dispatcher, steps, record, show=False):
    """EP × EFSDP × outer FSDP2 through fsdpturbo; with `record`, also what `train_steps`
    records and the final parameters (rank 0 keeps them)."""
    from fsdpturbo import clip_grad_norm_
    from fsdpturbo.engine import shard_model

    model = shard_model(build_model(args), train_config(args, dispatcher))
    history, records = train_steps(args, model, steps, clip_grad_norm_, record=record, show=show)
    return history, records, gathered(model) if record else None


def check_parity(args, history, records, params, world):
    """The same steps in one process on the whole global batch, in float32 (in two orders of the
    batch's rows) and in float64, each step started from the parameters the sharded step started
    from; then both references take the optimizer step with the sharded run's gradients. Every
    loss, grad norm, gradient element and updated parameter element of the sharded run is
    checked against the error model of `fsdpturbo.parity`. Returns whether all pass."""
    from fsdpturbo.parity import C, Reference

    reference = Reference(build_model(args), optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr))
    worst = {}  # what → (ratio of the bound, step, tensor, gate)

    def note(what, step, gate, name, ours):
        ratio = gate.ratio(name, ours)[0]
        if ratio >= worst.get(what, (-1.0,))[0]:
            worst[what] = (ratio, step, name, gate, ours)

    def step_fn(model, order):
        tokens = global_batch(args, step, world, model.config.vocab_size)[order]
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        return {"loss": loss, "grad norm": torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)}

    print(f"\nchecking against one process (float32 and float64 references, {args.steps} steps) ...", flush=True)
    for step, (start_params, grads) in enumerate(records):
        reference.load(start_params)
        gate = reference.step(step_fn, rows=world * args.batch)
        note("losses", step, gate, "loss", history[step][0])
        note("grad norms", step, gate, "grad norm", history[step][1])
        for name, grad in grads.items():
            note("gradients", step, gate, f"grad {name}", grad)
        after = records[step + 1][0] if step + 1 < len(records) else params
        gate = reference.optimizer_step(grads)
        for name, value in after.items():
            note("parameters after the step", step, gate, name, value)
    print(f"  bound per element: {C:g} × (the float32 reference's largest rounding in its tensor, or its expert's slice, "
          "+ 2^-24 |ref|)")
    print("  worst element, as a fraction of its bound:")
    for what, (ratio, step, name, _, _) in worst.items():
        print(f"  {what:<28}{ratio:>8.3f}   (step {step}, {name})")
    failed = [(what, w) for what, w in worst.items() if w[0] > 1]
    for what, (_, step, name, gate, ours) in failed:
        try:
            gate.check(name, ours, f"step {step}")
        except AssertionError as error:
            print(f"  {what}: {error}")
    print(f"  {'MISMATCH: the sharded run differs from' if failed else 'PARITY: the sharded run equals'} "
          f"the one-process run")
    return not failed


def plain_fsdp2_run(args, steps):
    """Plain FSDP2 over all ranks, no EP (every rank runs every expert): the baseline."""
    from torch.distributed.fsdp import fully_shard

    model = build_model(args)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    clip = lambda m, max_norm: torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)  # noqa: E731
    return train_steps(args, model, steps, clip)[0]


def compare_dispatchers(args, world, tokens_per_step):
    """Times each dispatcher (and, with --baseline, plain FSDP2) for `compare_steps` steps after
    a warm-up step; rank 0 prints each row as it is measured."""
    runs = [(d, lambda d=d: sharded_run(args, d, args.compare_steps + 1, record=False)[0]) for d in DISPATCHERS]
    if args.baseline:
        runs.append(("plain FSDP2 (no EP)", lambda: plain_fsdp2_run(args, args.compare_steps + 1)))
    if dist.get_rank() == 0:
        print(f"\ndispatchers ({world} ranks, ep={args.ep}, median of {args.compare_steps} steps, slowest rank):")
        print(f"  {'dispatcher':<22}{'ms/step':>10}{'tokens/s':>11}{'vs eager':>10}{'last loss':>12}", flush=True)
    base = None
    for name, run in runs:
        history = run()[1:]  # the first step warms up
        seconds = torch.tensor([sorted(h[2] for h in history)[len(history) // 2]])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        seconds = seconds.item()
        base = base or seconds
        if dist.get_rank() == 0:
            print(f"  {name:<22}{seconds * 1e3:>10.1f}{tokens_per_step / seconds:>11.0f}{base / seconds:>9.2f}×"
                  f"{history[-1][0]:>12.5f}", flush=True)


def main():
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens_per_step = world * args.batch * args.seq
    if rank == 0:
        print(f"{args.model} ({args.size}) on {world} gloo ranks: ep={args.ep}, "
              f"efsdp={args.efsdp or 'dp/ep'}, dispatcher={args.dispatcher}, "
              f"global batch {world * args.batch}×{args.seq} tokens")
    if rank == 0:
        print(f"  {'step':>4}{'loss':>11}{'grad norm':>12}{'tokens/s':>11}", flush=True)
    history, records, params = sharded_run(args, args.dispatcher, args.steps, record=not args.no_reference,
                                           show=True)
    ok = True
    if not args.no_reference:
        if rank == 0:
            ok = check_parity(args, history, records, params, world)
        flag = torch.tensor([int(ok)])
        dist.broadcast(flag, 0)
        ok = bool(flag.item())
    if not args.no_compare:
        compare_dispatchers(args, world, tokens_per_step)
    dist.destroy_process_group()
    # Leave without the interpreter's teardown, where a gloo rank sometimes aborts after a
    # complete run ("terminate called without an active exception": a torch teardown issue that
    # torchrun would report as this run failing).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
