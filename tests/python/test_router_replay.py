"""Routes that stay put (`fsdpturbo.moe.router_replay`), on 2 gloo ranks with ep 2: under
non-reentrant activation checkpointing the recomputed forward takes the first forward's routes
even when the recomputed router would pick others (simulated), and the gradients equal the run
without checkpointing bitwise; without the replay the same run fails or drifts. Routes recorded
in one forward are taken by a later one; routes of another batch or model are refused."""
import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks
from models import SEQ, build_model, full, train_config


def _sharded(family, world):
    import fsdpturbo
    from fsdpturbo.engine import shard_model

    state = fsdpturbo.ParallelState(world, ep_size=2).init_device_meshes("cpu")
    return shard_model(build_model(family), train_config(2), state=state)


def _routers(model):
    """{router name: its state}: the router in the state of every EP module (fsdpturbo.moe.ep_state)."""
    from fsdpturbo.moe.ep_state import ep_modules, state

    routers = {state(m).router.name: state(m).router for _, m in ep_modules(model)}
    assert all(dict(model.named_modules())[name] is router.module for name, router in routers.items())
    return routers


def _flip_when_recomputed(model):
    """Makes every router pick other experts whenever it runs inside backward (a recomputation),
    as nondeterministic kernels or a near tie could."""
    from fsdpturbo.moe.recompute import in_recomputation

    for router in _routers(model).values():
        original = router.original

        def flipped(hidden, original=original, experts=router.module.num_experts):
            logits, scores, indices = original(hidden)
            return (logits, scores, (indices + 1) % experts) if in_recomputation() else (logits, scores, indices)

        router.original = flipped


def _grads(family, world, rank, *, checkpointing, flip=False, replay=True):
    model = _sharded(family, world)
    assert len(_routers(model)) == model.config.num_hidden_layers
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if flip:
        _flip_when_recomputed(model)
    if not replay:
        for router in _routers(model).values():
            router.checkpointed = lambda: False
    model.train()
    ids = torch.randint(0, 64, (world, SEQ), generator=torch.Generator().manual_seed(11))[rank:rank + 1]
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: full(p.grad).clone() for n, p in model.named_parameters()}


def _recompute_rank_fn(rank, world, family):
    plain = _grads(family, world, rank, checkpointing=False)
    replayed = _grads(family, world, rank, checkpointing=True, flip=True)
    for name, grad in plain.items():
        assert torch.equal(replayed[name], grad), f"{family}: {name} gradient differs under checkpointing"
    try:
        unreplayed = _grads(family, world, rank, checkpointing=True, flip=True, replay=False)
    except Exception:  # noqa: BLE001  (the recomputation's other routes break the backward: expected)
        unreplayed = None
    flags = torch.tensor([unreplayed is None or any(not torch.equal(unreplayed[n], g) for n, g in plain.items())])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    assert bool(flags), f"{family}: the flipped recomputation went unnoticed without the replay (the test is blind)"


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_recompute_takes_the_first_forwards_routes(family):
    run_ranks(_recompute_rank_fn, 2, family, timeout=240)


def _replay_rank_fn(rank, world):
    from fsdpturbo import record_routes, replay_routes

    model = _sharded("qwen3_moe", world)
    model.eval()
    ids = torch.randint(0, 64, (world, SEQ), generator=torch.Generator().manual_seed(12))[rank:rank + 1]
    with torch.no_grad(), record_routes(model) as routes:
        model(input_ids=ids)
    assert all(len(v) == 1 and v[0].shape == (SEQ, 2) for v in routes.values())
    received = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(lambda m, args, name=name: received.__setitem__(name, args[1].clone()))
    with torch.no_grad():
        for router in _routers(model).values():
            weight = router.module.weight
            weight.to_local().normal_() if hasattr(weight, "to_local") else weight.normal_()
        with replay_routes(model, routes):
            model(input_ids=ids)
    for name, recorded in routes.items():
        assert torch.equal(received[name.rpartition(".")[0] + ".experts"], recorded[0]), f"{name}: not replayed"
    with torch.no_grad(), replay_routes(model, routes), pytest.raises(ValueError, match="routes of another batch"):
        model(input_ids=ids[:, :SEQ - 1])
    with torch.no_grad(), replay_routes(model, routes), pytest.raises(ValueError, match="no recorded route left"):
        model(input_ids=ids)
        model(input_ids=ids)
    with pytest.raises(ValueError, match="the routes are for"):
        with replay_routes(model, {"model.layers.9.mlp.gate": []}):
            pass


def test_recorded_routes_are_replayed():
    run_ranks(_replay_rank_fn, 2, timeout=200)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputed_scores_are_the_routers_own(family, dtype):
    """The scores the replay computes for the router's own ids are bitwise what the Hugging Face
    router returns."""
    from fsdpturbo.moe.router_replay import _scores

    router = build_model(family).to(dtype).model.layers[0].mlp.gate
    torch.nn.init.normal_(router.weight)
    logits, scores, indices = router(torch.randn(500, router.hidden_dim, dtype=dtype))
    assert torch.equal(_scores(router, logits, indices), scores)
