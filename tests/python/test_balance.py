"""Load balancing under `shard_model` (`fsdpturbo.moe.balance`, `fsdpturbo.moe.expert_bias`) on 4 gloo
ranks against the same Hugging Face model run in one process on the whole global batch, for
Qwen3-MoE (ep 2, efsdp 2) and Qwen3.5-MoE (ep 4), with activation checkpointing:

* global aux loss + z-loss, 2 micro-batches in `balance_step`, padded rows: per micro-batch the
  loss, `aux_loss` (Hugging Face's value on the micro-batch's concatenation × its share of the
  step's tokens) and `z_loss`; after the step every gradient;
* sequence scope: Hugging Face's aux loss of each sequence, averaged over the step's sequences;
* local scope: each rank's `aux_loss` is plain Hugging Face's on its own rows (the z-loss
  still the global batch's);
* bad use: micro-batches that do not match `balance_step`'s masks, a z-loss without router
  logits, an expert bias without EP, the sequence scope with cp > 1;
* expert bias: selection by probability + bias with the router's own weights, the update from
  the global counts (`expert_load`), identical on every rank (and the check that says when not),
  gradients of two steps equal to the one-process model with the same biased routers, a
  bitwise checkpoint round trip to another layout (`load_checkpoint`, and `dcp_path` on a meta
  model); bad biases are clear errors.

Tolerance: per element, the error model of `fsdpturbo.parity` (the one-process model in float32
and float64, the sharded run within C times the float32 reference's rounding)."""
import contextlib

import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks
from fsdpturbo.moe.ep_state import ep_modules, state
from models import SEQ, full, tiny_config, train_config

# also run against LlamaFactory's transformers; and on the other instruction sets (ctest parity_*)
pytestmark = [pytest.mark.transformers_5_8, pytest.mark.parity]

ROWS = 2  # sequences per rank and micro-batch
MICRO_BATCHES = 2
AUX_COEF, Z_COEF, BIAS_RATE = 0.5, 0.1, 0.01
LAYOUTS = {"qwen3_moe": (dict(ep=2), dict(ep=4)), "qwen3_5_moe": (dict(ep=4), dict(ep=2))}


def _model(family):
    config = tiny_config(family)
    config.output_router_logits, config.router_aux_loss_coef = True, AUX_COEF
    torch.manual_seed(0)
    if family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM as Model
    else:
        from transformers import Qwen3MoeForCausalLM as Model
    return Model(config)


def _sharded(family, world, layout, *, meta=False, **dist_config):
    """The model sharded at `layout` with `dist_config` keys; meta: built on the meta device
    (then `dcp_path` gives the weights)."""
    import fsdpturbo
    from fsdpturbo.engine import shard_model

    cp = layout.get("cp", 1)
    state = fsdpturbo.ParallelState(world, cp_size=cp, ep_size=layout["ep"]).init_device_meshes("cpu")
    config = train_config(layout["ep"], cp=cp)
    config["dist_config"].update(dist_config)
    with fsdpturbo.meta_parameters() if meta else contextlib.nullcontext():
        model = _model(family)
    model = shard_model(model, config, state=state)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _micro_batches(world, padded):
    """[(ids, mask, labels)] of the global batch (world × ROWS rows) per micro-batch; padded:
    some rows end in padding (mask 0, label -100)."""
    g = torch.Generator().manual_seed(5)
    rows, batches = world * ROWS, []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, 64, (rows, SEQ), generator=g)
        lengths = torch.randint(2, SEQ + 1, (rows,), generator=g) if padded else torch.full((rows,), SEQ)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        batches.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    return batches


def _mine(t, rank):
    return t[rank * ROWS:(rank + 1) * ROWS]


def _reference(family):
    from fsdpturbo.parity import Reference

    return Reference(_model(family))


def _grads(model):
    return {f"grad {name}": full(param.grad) for name, param in model.named_parameters()}


def _mean_over_ranks(value, world):
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / world


def _label_tokens(batches):
    return sum(int((labels[:, 1:] != -100).sum()) for _, _, labels in batches)


def _z(router_logits, mask):
    """ST-MoE's z-loss numerator: Σ over the layers' unmasked rows of logsumexp(logits)²."""
    weights = mask.reshape(-1).float()
    return sum((torch.logsumexp(l.float(), -1).square() * weights).sum() for l in router_logits)


def _hf_aux(model):
    import sys

    fn = sys.modules[type(model).__module__].load_balancing_loss_func
    return getattr(fn, "ft_original", fn)


def _per_sequence_aux(model, router_logits, mask):
    """Σ over the rows of Hugging Face's aux loss of each row alone."""
    experts, k = model.config.num_experts, model.config.num_experts_per_tok
    rows = mask.size(0)
    return sum(_hf_aux(model)(tuple(l.view(rows, SEQ, -1)[b] for l in router_logits), experts, k, mask[b:b + 1])
               for b in range(rows))


def _accumulated_step(rank, world, family, layout, scope):
    """Two padded micro-batches in `balance_step` with the aux loss of `scope` and the z-loss,
    against the one-process model on each micro-batch's concatenation."""
    import fsdpturbo

    what = f"{family} {layout} {scope}"
    model = _sharded(family, world, layout, aux_loss_scope=scope, router_z_loss_coef=Z_COEF)
    reference = _reference(family)
    batches = _micro_batches(world, padded=True)
    labels_total = _label_tokens(batches)
    tokens = sum(int(mask.sum()) for _, mask, _ in batches)
    sequences = MICRO_BATCHES * world * ROWS
    layers = model.config.num_hidden_layers
    ours = {}
    with fsdpturbo.balance_step(model, [_mine(mask, rank) for _, mask, _ in batches]):
        for m, (ids, mask, labels) in enumerate(batches):
            out = model(input_ids=_mine(ids, rank), attention_mask=_mine(mask, rank), labels=_mine(labels, rank),
                        num_items_in_batch=labels_total / world, use_cache=False)
            out.loss.backward()
            ours.update({f"{m} aux_loss": out.aux_loss, f"{m} z_loss": out.z_loss,
                         f"{m} loss": _mean_over_ranks(out.loss, world)})

    def step_fn(ref_model, order):
        scalars = {}
        for m, (ids, mask, labels) in enumerate(batches):
            ids, mask, labels = ids[order], mask[order], labels[order]
            ref = ref_model(input_ids=ids, attention_mask=mask, use_cache=False)
            experts, k = ref_model.config.num_experts, ref_model.config.num_experts_per_tok
            assert torch.equal(ref.aux_loss, _hf_aux(ref_model)(ref.router_logits, experts, k, mask)), \
                f"{what}: the patched function changed an unsharded model's aux loss"
            ce = ref_model.loss_function(ref.logits, labels, ref_model.config.vocab_size,
                                         num_items_in_batch=labels_total)
            if scope == "sequence":
                aux = _per_sequence_aux(ref_model, ref.router_logits, mask) / sequences
            else:
                aux = ref.aux_loss * mask.sum() / tokens  # HF's value on the micro-batch × its token share
            z = _z(ref.router_logits, mask) / (layers * tokens)
            (ce + AUX_COEF * aux + Z_COEF * z).backward()
            scalars.update({f"{m} aux_loss": aux, f"{m} z_loss": z, f"{m} loss": ce + AUX_COEF * aux + Z_COEF * z})
        return scalars

    gate = reference.step(step_fn, rows=world * ROWS)
    gate.check_all(ours, f"{what} micro-batch")
    gate.check_all(_grads(model), what)
    with pytest.raises(ValueError, match="router_z_loss_coef needs the router logits"):
        model(input_ids=_mine(ids, rank), output_router_logits=False, use_cache=False)


def _misuse(rank, world, family, layout):
    """balance_step's declared micro-batches must match the forwards; an expert bias needs EP;
    the sequence scope is not built with cp > 1. Every rank raises."""
    import fsdpturbo

    model = _sharded(family, world, layout)
    ids, mask, _ = _micro_batches(world, padded=False)[0]
    with pytest.raises(ValueError, match=r"micro-batch 0 has shape \[2, 3\], its declared attention mask \[2, 6\]"):
        with fsdpturbo.balance_step(model, [_mine(mask, rank)]):
            model(input_ids=_mine(ids, rank)[:, :3], use_cache=False)
    with pytest.raises(ValueError, match="the step declared 2 micro-batches and 1 forwards ran"):
        with fsdpturbo.balance_step(model, [_mine(mask, rank)] * 2):
            model(input_ids=_mine(ids, rank), use_cache=False)
    with pytest.raises(ValueError, match="expert_bias_update_rate needs expert parallelism"):
        _sharded(family, world, dict(ep=1), expert_bias_update_rate=BIAS_RATE)
    with pytest.raises(NotImplementedError, match="aux_loss_scope sequence with cp_size > 1 is not built"):
        _sharded(family, world, dict(ep=2, cp=2), aux_loss_scope="sequence")


def _local_scope(rank, world, family, layout):
    """aux_loss_scope local: each rank's aux loss is plain Hugging Face's on its own rows, the
    z-loss the global batch's; the gradients are those of the mean over ranks of the per-rank
    losses plus the global z-loss."""
    what = f"{family} {layout} local"
    model = _sharded(family, world, layout, aux_loss_scope="local", router_z_loss_coef=Z_COEF)
    reference = _reference(family)
    ids, mask, labels = _micro_batches(world, padded=True)[0]
    out = model(input_ids=_mine(ids, rank), attention_mask=_mine(mask, rank), labels=_mine(labels, rank),
                use_cache=False)
    out.loss.backward()

    def step_fn(ref_model, order):
        """The rows of each rank stay that rank's (`order` permutes within them)."""
        per_rank_losses, z, scalars = 0, 0, {}
        for r in range(world):
            rows = _mine(order, r)
            ref = ref_model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows], use_cache=False)
            per_rank_losses, z = per_rank_losses + ref.loss / world, z + _z(ref.router_logits, mask[rows])
            scalars[f"rank {r} aux_loss"] = ref.aux_loss
        z = z / (ref_model.config.num_hidden_layers * mask.sum())
        (per_rank_losses + Z_COEF * z).backward()
        return {**scalars, "z_loss": z}

    forward = torch.arange(world * ROWS)
    within_ranks = torch.cat([_mine(forward, r).flip(0) for r in range(world)])
    gate = reference.step(step_fn, orders=[forward, within_ranks])
    gate.check(f"rank {rank} aux_loss", out.aux_loss, what)
    gate.check("z_loss", out.z_loss, what)
    gate.check_all(_grads(model), what)


def _routers(model):
    return {name: m for name, m in model.named_modules() if name.endswith("mlp.gate")}


def _bias_reference_router(router, bias):
    """The one-process router taking its top-k by probability + `bias`, weights its own."""
    def forward(hidden):
        logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        chosen = torch.topk(probs + bias, router.top_k, dim=-1).indices
        top = probs.gather(-1, chosen)
        return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), chosen

    router.forward = forward


def _selection(rank, world, model, what):
    """A bias on one expert puts it in every row's top-k; the weights stay the router's own."""
    router = model.model.layers[0].mlp.gate
    seen = []
    handle = router.register_forward_hook(lambda module, args, output: seen.append(output))
    router.expert_bias[3] = 1.0
    ids = _micro_batches(world, padded=False)[0][0]
    with torch.no_grad():
        model(input_ids=_mine(ids, rank), use_cache=False)
    handle.remove()
    router.expert_bias.zero_()
    logits, scores, chosen = seen[0]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    assert (chosen == 3).any(-1).all(), f"{what}: biased expert 3 missing from some top-k {chosen.tolist()}"
    assert not torch.equal(chosen.sort(-1).values, probs.topk(router.top_k).indices.sort(-1).values), \
        f"{what}: the bias changed no selection"
    top = probs.gather(-1, chosen)
    # the same float32 operations on this rank's own logits, the top-k sum perhaps in another order
    torch.testing.assert_close(scores, top / top.sum(-1, keepdim=True), rtol=4 * 2.0 ** -24, atol=0,
                               msg=f"{what}: weights of the biased selection")
    # The experts' tally counted the forward (expert_load), but not as a training forward (the bias).
    tallies = [state(m).tally for _, m in ep_modules(model)]
    assert tallies and all(int(t.window("routed").sum()) > 0 for t in tallies), what
    assert all(int(t.window("trained").sum()) == 0 for t in tallies), f"{what}: a forward without grad was counted " \
                                                                       f"for the bias"


def _bias_steps(rank, world, family, layout, tmp):
    """Two steps with the expert bias: gradients equal the one-process model with the same biased
    routers (started from the sharded model's parameters at each step); each update equals the hand computation from the global counts; identical on every
    rank; a checkpoint carries it bitwise to another layout; bad biases are clear errors."""
    import fsdpturbo

    what = f"{family} {layout} expert bias"
    model = _sharded(family, world, layout, expert_bias_update_rate=BIAS_RATE)
    routers = _routers(model)
    assert all(torch.equal(r.expert_bias, torch.zeros(r.num_experts)) for r in routers.values()), what
    _selection(rank, world, model, what)
    fsdpturbo.expert_load(model)  # reset: the dispatch tallies count forwards without grad too
    reference = _reference(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (ids, _, _) in enumerate(_micro_batches(world, padded=False)):
        before = {name: r.expert_bias.clone() for name, r in routers.items()}
        for ref_model in (reference.model, reference.model64):
            for name, router in _routers(ref_model).items():
                _bias_reference_router(router, before[name])
        reference.load({name: full(param) for name, param in model.named_parameters()})
        micro_batches = (ids[:, :SEQ // 2], ids[:, SEQ // 2:])  # 2 micro-batches of the step
        for micro in micro_batches:
            model(input_ids=_mine(micro, rank), labels=_mine(micro, rank), use_cache=False).loss.backward()

        def step_fn(ref_model, order):
            for micro in micro_batches:
                ref_model(input_ids=micro[order], labels=micro[order], use_cache=False).loss.backward()

        gate = reference.step(step_fn, rows=world * ROWS)
        gate.check_all(_grads(model), f"{what} step {step}")
        loads = fsdpturbo.expert_load(model)
        optimizer.step()
        optimizer.zero_grad()
        fsdpturbo.update_expert_bias(model)
        for name, router in routers.items():
            load = loads[name.replace(".gate", ".experts")].float()
            expected = before[name] + BIAS_RATE * torch.sign(load.mean() - load)
            assert torch.equal(router.expert_bias, expected), f"{what} step {step} {name}: bias " \
                f"{router.expert_bias.tolist()}, from the loads {load.tolist()}: {expected.tolist()}"
        gathered = [None] * world
        dist.all_gather_object(gathered, [r.expert_bias.tolist() for r in routers.values()])
        assert all(g == gathered[0] for g in gathered), f"{what} step {step}: ranks disagree"
    assert any(r.expert_bias.abs().sum() > 0 for r in routers.values()), f"{what}: no bias moved"

    first = next(iter(routers.values()))
    if rank == 1:
        first.expert_bias[0] += 1e-3
    with pytest.raises(RuntimeError, match="differs between ranks"):
        fsdpturbo.update_expert_bias(model)
    first.expert_bias.copy_(torch.tensor(gathered[0][0]))  # every rank back to the common bias

    saved = {name: r.expert_bias.clone() for name, r in routers.items()}
    fsdpturbo.save_checkpoint(model, optimizer, f"{tmp}/{family}")
    other = _sharded(family, world, LAYOUTS[family][1], expert_bias_update_rate=BIAS_RATE)
    fsdpturbo.load_checkpoint(other, None, f"{tmp}/{family}")
    resumed = _sharded(family, world, LAYOUTS[family][1], meta=True, expert_bias_update_rate=BIAS_RATE,
                       dcp_path=f"{tmp}/{family}")
    for loaded, how in ((other, "load_checkpoint"), (resumed, "dcp_path on a meta model")):
        for name, router in _routers(loaded).items():
            assert torch.equal(router.expert_bias, saved[name]), f"{what}: {name} after the round trip by {how}"

    experts = first.num_experts
    first.expert_bias = torch.zeros(experts, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"model.layers.0.mlp.gate.expert_bias has shape \[{experts}\] and dtype "
                                         rf"torch.float64; the router has {experts} experts"):
        fsdpturbo.update_expert_bias(model)
    first.expert_bias = torch.zeros(experts + 1)
    fsdpturbo.save_checkpoint(model, None, f"{tmp}/{family}-wrong")
    with pytest.raises(ValueError, match=rf"model.layers.0.mlp.gate.expert_bias: the checkpoint has shape "
                                         rf"\[{experts + 1}\], the model \[{experts}\]"):
        fsdpturbo.load_checkpoint(other, None, f"{tmp}/{family}-wrong")
    with pytest.raises(ValueError, match=rf"model.layers.0.mlp.gate.expert_bias has shape \[{experts + 1}\]"):
        model(input_ids=_mine(ids, rank), use_cache=False)


def _balance_rank_fn(rank, world, family, tmp):
    layout = LAYOUTS[family][0]
    _accumulated_step(rank, world, family, layout, "global")
    _accumulated_step(rank, world, family, layout, "sequence")
    _local_scope(rank, world, family, layout)
    _misuse(rank, world, family, layout)
    _bias_steps(rank, world, family, layout, tmp)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_balance_losses_and_expert_bias_equal_single_process(family, tmp_path):
    run_ranks(_balance_rank_fn, 4, family, str(tmp_path), timeout=400)


def test_balance_step_needs_a_sharded_model():
    import fsdpturbo

    with pytest.raises(ValueError, match="the model has no balance losses"):
        with fsdpturbo.balance_step(_model("qwen3_moe"), [torch.ones(1, SEQ)]):
            pass
    with pytest.raises(ValueError, match="the model has no expert bias"):
        fsdpturbo.update_expert_bias(_model("qwen3_moe"))
