"""torch.compile (inductor, on CPU) of EP blocks and of a whole sharded model, against the same
modules run eagerly on gloo ranks; and the graph breaks `torch._dynamo.explain` lists, each one
that must be:

- the dropless dispatchers: one per MoE forward, where the gathered counts reach the host (the
  all-to-all split sizes, DESIGN §4.5; `pipeline.run`), which dynamo reports in every frame
  it unwinds through;
- the capacity-bounded dispatch: none (the block compiles with `fullgraph=True`);
- FSDP2: its hooks run under `torch._dynamo.disable` (`_fsdp_common.py`).

Compiled and eager runs round differently (inductor fuses the activation, the softmax, the
weighted combine): each element agrees within 1e-6 of itself, floored at 2e-6 of the tensor's
largest element (the rounding a cancelling sum carries; the worst measured, an attention weight
gradient six layers deep, needs 1.07e-6)."""
import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks
from fsdpturbo.dispatch import Capacity
from test_capacity import TOKENS, _ep_block, _step
from test_ep import _data

RTOL = 1e-6
ATOL_OF_MAX = 2e-6
VARIANTS = {"eager": ("eager", None), "fused": ("fused", None), "domino": ("domino", None),
            "capacity eager": ("eager", Capacity(factor=2.0)), "capacity fused": ("fused", Capacity(factor=2.0))}
# The frames that may break a graph, as (file, function) of the innermost user frame.
HOST_READ = ("pipeline.py", "run")
FSDP_HOOKS = ("_fsdp_common.py", "wrapper")


def _assert_close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL_OF_MAX * expected.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


def _breaks(explained):
    """The (file, function) of the innermost user frame of each graph break."""
    return {(b.user_stack[-1].filename.rsplit("/", 1)[-1], b.user_stack[-1].name) for b in explained.break_reasons}


def _blocks_rank_fn(rank, world, variants):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
    for name in variants:
        dispatcher, capacity = VARIANTS[name]
        eager = _ep_block(mesh, dispatcher, capacity, torch.float32)
        compiled = torch.compile(_ep_block(mesh, dispatcher, capacity, torch.float32), fullgraph=capacity is not None)
        for seed in (1, 2):  # a second batch routes differently: the dropless graphs take other split sizes
            x_all, cotangent = _data(world, torch.float32, seed=seed)
            want = _step(eager, x_all[rows], cotangent[rows])
            got = _step(compiled, x_all[rows], cotangent[rows])
            for label, a, b in zip(("output", "input grad", "router grad", "gate_up grad", "down grad"), got, want):
                _assert_close(a, b, f"{name} batch {seed} {label}")
        explained = torch._dynamo.explain(_ep_block(mesh, dispatcher, capacity, torch.float32))(
            _data(world, torch.float32)[0][rows].unsqueeze(0))
        if capacity is None:
            assert explained.graph_break_count > 0 and _breaks(explained) == {HOST_READ}, _breaks(explained)
        else:
            assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.parametrize("variants", [("eager", "fused", "domino"), ("capacity eager", "capacity fused")])
def test_compiled_blocks_equal_eager(variants):
    run_ranks(_blocks_rank_fn, 2, variants, timeout=900)


def _model_rank_fn(rank, world, capacity_factor):
    """shard_model (EP 2 × FSDP2) of a LAYERS-layer Qwen3-MoE compiled whole, 2 SGD steps against
    the same model run eagerly (use_cache=False, as in training):
    losses, every gradient and the parameters after the steps (SGD: AdamW's normalisation
    turns rounding in near-zero gradients into lr-sized steps, which would hide the comparison)."""
    from test_train import batch, full, tiny_config, train_config
    from transformers import Qwen3MoeForCausalLM

    from fsdpturbo.engine import shard_model

    torch._dynamo.config.recompile_limit = 4  # this rank's own process
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    hf_config = tiny_config("qwen3_moe")
    hf_config.num_hidden_layers = LAYERS
    config = train_config(world, dispatcher="fused", capacity_factor=capacity_factor)
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = shard_model(Qwen3MoeForCausalLM(hf_config), config)
        run = torch.compile(model) if compiled else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = []
        for step in range(2):
            ids = batch(step, world)[rank:rank + 1]
            loss = run(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            steps.append((loss.detach(), {n: full(p.grad) for n, p in model.named_parameters()}))
            optimizer.step()
            optimizer.zero_grad()
        runs.append((steps, {n: full(p) for n, p in model.named_parameters()}, model))
    (want_steps, want_params, _), (got_steps, got_params, model) = runs
    for step, ((want_loss, want_grads), (got_loss, got_grads)) in enumerate(zip(want_steps, got_steps)):
        _assert_close(got_loss, want_loss, f"step {step} loss")
        for name in want_grads:
            _assert_close(got_grads[name], want_grads[name], f"step {step} grad {name}")
    for name in want_params:
        _assert_close(got_params[name], want_params[name], f"parameter {name}")
    ids = batch(0, world)[rank:rank + 1]
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids, use_cache=False)
    allowed = {FSDP_HOOKS} if capacity_factor is not None else {FSDP_HOOKS, HOST_READ}
    assert _breaks(explained) <= allowed, _breaks(explained)
    dist.barrier()


# More decoder layers than the recompile limit below: a frame specialised per layer (a layer's
# name in a traced string, a routing's split sizes) fails the test instead of quietly falling
# back to eager. (transformers' own deprecation wrapper takes 4 versions.)
LAYERS = 6


@pytest.mark.parametrize("capacity_factor", [None, 4.0], ids=["dropless", "capacity"])
def test_compiled_sharded_model_trains_like_eager(capacity_factor):
    run_ranks(_model_rank_fn, 2, capacity_factor, timeout=1200)
