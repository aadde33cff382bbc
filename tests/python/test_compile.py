"""torch.compile (inductor, on CPU) of EP blocks and of a whole sharded model, against the same
modules run eagerly on gloo ranks; and the graph breaks `torch._dynamo.explain` lists, each one
that must be:

- the dropless dispatchers: one per MoE forward, where the gathered counts reach the host (the
  all-to-all split sizes, docs/design.md §4.5; `pipeline.run`), which dynamo reports in every frame
  it unwinds through;
- the capacity-bounded dispatch: none (the block compiles with `fullgraph=True`);
- FSDP2: its hooks run under `torch._dynamo.disable` (`_fsdp_common.py`).

Compiled and eager runs round differently (inductor fuses the activation, the softmax, the
weighted combine), so a compiled run is checked with the error model of `fsdpturbo.parity`: a
compiled block against the same EP block run eagerly in float32 and in float64 (the capacity
mode drops the same slots in both), a compiled sharded model against the one-process model in
float32 and float64 at every step."""
import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks
from fsdpturbo import parity
from fsdpturbo.moe.dispatch import Capacity
from models import batch, full, tiny_config, train_config
from blocks import TOKENS_PER_RANK, block_data, ep_block, ep_step
from graph_breaks import FSDP_HOOKS, HOST_READ, graph_breaks

pytestmark = pytest.mark.parity  # also run on the other instruction sets (ctest parity_*)

VARIANTS = {"eager": ("eager", None), "fused": ("fused", None), "domino": ("domino", None),
            "capacity eager": ("eager", Capacity(factor=2.0)), "capacity fused": ("fused", Capacity(factor=2.0))}


def _blocks_rank_fn(rank, world, variants):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    for name in variants:
        dispatcher, capacity = VARIANTS[name]
        eager = ep_block(mesh, dispatcher, capacity, torch.float32)
        eager64 = ep_block(mesh, dispatcher, capacity, torch.float64)
        compiled = torch.compile(ep_block(mesh, dispatcher, capacity, torch.float32), fullgraph=capacity is not None)
        for seed in (1, 2):  # a second batch routes differently: the dropless graphs take other split sizes
            x_all, cotangent = block_data(world, torch.float32, seed=seed)
            routes = []
            with parity.recording_routes(routes):
                want = ep_step(eager, x_all[rows], cotangent[rows])
            with parity.float64_mode(replay=routes):
                want64 = ep_step(eager64, x_all[rows], cotangent[rows])
            parity.gate(want64, [want]).check_all(ep_step(compiled, x_all[rows], cotangent[rows]),
                                                  f"{name} batch {seed}")
        explained = torch._dynamo.explain(ep_block(mesh, dispatcher, capacity, torch.float32))(
            block_data(world, torch.float32)[0][rows].unsqueeze(0))
        if capacity is None:
            assert explained.graph_break_count > 0 and graph_breaks(explained) == {HOST_READ}, graph_breaks(explained)
        else:
            assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.parametrize("variants", [("eager", "fused", "domino"), ("capacity eager", "capacity fused")])
def test_compiled_blocks_equal_eager(variants):
    run_ranks(_blocks_rank_fn, 2, variants, timeout=900)


def _model_rank_fn(rank, world, capacity_factor):
    """shard_model (EP 2 × FSDP2) of a LAYERS-layer Qwen3-MoE compiled whole, 2 SGD steps
    (use_cache=False, as in training), each against the one-process model in float32 and
    float64 from the compiled run's parameters: loss, every gradient and the parameters after
    the step (the references step with the compiled run's gradients). The capacity factor
    leaves room for every slot, so the one-process model is the reference in both modes."""
    from transformers import Qwen3MoeForCausalLM

    from fsdpturbo.engine import shard_model

    torch._dynamo.config.recompile_limit = 4  # this rank's own process
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    hf_config = tiny_config("qwen3_moe")
    hf_config.num_hidden_layers = LAYERS
    config = train_config(world, dispatcher="fused", capacity_factor=capacity_factor)
    torch.manual_seed(0)
    reference = parity.Reference(Qwen3MoeForCausalLM(hf_config),
                                 optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    torch.manual_seed(0)
    model = shard_model(Qwen3MoeForCausalLM(hf_config), config)
    run = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        reference.load({n: full(p) for n, p in model.named_parameters()})
        ids = batch(step, world)

        def step_fn(ref, order):
            loss = ref(input_ids=ids[order], labels=ids[order], use_cache=False).loss
            loss.backward()
            return {"loss": loss}

        gate = reference.step(step_fn, rows=world)
        loss = run(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1], use_cache=False).loss
        loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        gate.check("loss", mean_loss / world, f"step {step}")
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        gate.check_all({f"grad {n}": g for n, g in grads.items()}, f"step {step}")
        gate = reference.optimizer_step(grads)
        optimizer.step()
        optimizer.zero_grad()
        gate.check_all({n: full(p) for n, p in model.named_parameters()}, f"after step {step}")
    ids = batch(0, world)[rank:rank + 1]
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids, use_cache=False)
    allowed = {FSDP_HOOKS} if capacity_factor is not None else {FSDP_HOOKS, HOST_READ}
    assert graph_breaks(explained) <= allowed, graph_breaks(explained)
    dist.barrier()


# More decoder layers than the recompile limit below: a frame specialised per layer (a layer's
# name in a traced string, a routing's split sizes) fails the test instead of quietly falling
# back to eager. (transformers' own deprecation wrapper takes 4 versions.)
LAYERS = 6


@pytest.mark.parametrize("capacity_factor", [None, 4.0], ids=["dropless", "capacity"])
def test_compiled_sharded_model_trains_like_one_process(capacity_factor):
    run_ranks(_model_rank_fn, 2, capacity_factor, timeout=1200)
