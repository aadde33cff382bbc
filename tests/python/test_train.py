"""Training with `fsdpturbo.engine.shard_model` (EP × EFSDP × outer FSDP2; context parallelism
through the test-level Ulysses of `ulysses`) on gloo ranks against the same Hugging Face model
trained in one process on the whole global batch: losses, gathered gradients, grad norms and
parameters over 3 AdamW steps, element by element within the error model of
`fsdpturbo.parity`, in float32 and in bf16 (docs/design.md §4.1)."""
import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks
from models import LR, SEQ, STEPS, batch, build_model, full, layout_state, loss_and_norm_step, positions, rank_loss, train_config

# also run against LlamaFactory's transformers; and on the other instruction sets (ctest parity_*)
pytestmark = [pytest.mark.transformers_5_8, pytest.mark.parity]



def _train_rank_fn(rank, world, family, layouts):
    """Each step starts the one-process references (float32, float64: fsdpturbo.parity) from the
    sharded model's parameters, so the loss, every gradient and the grad norm are compared at
    the same point; the references then take their AdamW step with the sharded run's (clipped)
    gradients, so the parameters compare the sharded update with the one-process update. With
    cp > 1 each data-parallel rank's sequence is cp times as long and split over its CP group
    (Ulysses): the same tokens as at cp 1, the same number of sequences as data-parallel ranks."""
    from fsdpturbo import clip_grad_norm_
    from fsdpturbo.engine import shard_model
    from fsdpturbo.parity import Reference

    import ulysses

    for layout in layouts:
        where = f"{family} {layout}"
        ep, efsdp, cp, ignored = layout["ep"], layout.get("efsdp"), layout.get("cp", 1), layout.get("ignored", ())
        state = layout_state(world, ep, efsdp, cp)
        assert state.world_size == world
        reference = Reference(build_model(family), optimizer=lambda params: torch.optim.AdamW(params, lr=LR))
        config = train_config(ep, efsdp, cp, ignored=ignored, dispatcher=layout.get("dispatcher", "eager"),
                              capacity_factor=layout.get("capacity_factor"))
        model = shard_model(build_model(family), config, state=state)
        if cp > 1:
            ulysses.install(model, state.sub_mesh("cp").get_group())
        from torch.distributed.tensor import DTensor

        assert isinstance(model.model.embed_tokens.weight, DTensor) != bool(ignored)  # kept whole when ignored
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        dp = world // cp
        for step in range(STEPS):
            reference.load({name: full(param) for name, param in model.named_parameters()})
            ids = batch(step, world).view(dp, cp * SEQ)
            loss = rank_loss(model, state, family, ids)
            loss.backward()
            position_ids = positions(family, dp, cp * SEQ) if cp > 1 else None
            gate = reference.step(loss_and_norm_step(ids, position_ids), rows=dp)
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            gate.check("loss", mean_loss / world, f"{where} step {step}")
            gate.check_all({f"grad {name}": full(param.grad) for name, param in model.named_parameters()},
                           f"{where} step {step}")
            gate.check("grad norm", clip_grad_norm_(model, 1.0), f"{where} step {step}")
            gate = reference.optimizer_step({name: full(param.grad) for name, param in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
            gate.check_all({name: full(param) for name, param in model.named_parameters()},
                           f"{where} after step {step}")


# On 4 ranks; efsdp None = the seed's dp/ep (2 with ep 2, 1 with ep 4).
LAYOUTS = [dict(ep=2), dict(ep=4), dict(ep=2, efsdp=1), dict(ep=2, cp=2)]
# Capacity factor 8: every expert can take all of a rank's slots (SEQ tokens × top-2 of 8 experts).
EXTRA = {"qwen3_moe": [dict(ep=2, ignored=("model.embed_tokens", "model.norm")), dict(ep=2, dispatcher="fused"),
                       dict(ep=2, dispatcher="fused", capacity_factor=8.0), dict(ep=2, cp=2, dispatcher="fused")],
         "qwen3_5_moe": [dict(ep=4, dispatcher="domino"), dict(ep=2, dispatcher="eager", capacity_factor=8.0),
                         dict(ep=2, cp=2, dispatcher="fused")]}


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_three_adamw_steps_equal_single_process(family):
    """(ep 2, efsdp 2), (ep 4, efsdp 1), (ep 2, efsdp 1, edp 2) and (cp 2, ep 2) on 4 ranks, the
    last with every sequence split over its CP group (Ulysses; also fused, Qwen3.5 with
    multi-axis mRoPE ids); also parameters kept whole outside FSDP2 (fsdp_ignored_modules), the
    fused and domino dispatchers and the capacity-bounded dispatch (with room for every slot)."""
    run_ranks(_train_rank_fn, 4, family, LAYOUTS + EXTRA[family], timeout=400)


# The context-parallel layouts of the seed's own runs, on 8 ranks.
EIGHT_RANKS = {"qwen3_moe": [dict(ep=2, efsdp=2, cp=2)], "qwen3_5_moe": [dict(ep=4, cp=2, dispatcher="fused")]}


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_context_parallel_at_eight_ranks(family):
    """cp 2 · ep 2 · efsdp 2 (Qwen3-MoE, eager) and cp 2 · ep 4 (Qwen3.5-MoE, fused) on 8 ranks:
    the seed's CP layouts, every sequence split over its CP group, checked as the 4-rank ones."""
    run_ranks(_train_rank_fn, 8, family, EIGHT_RANKS[family], timeout=600)



def _no_view_output_rank_fn(rank, world):
    """FSDP2 warns when a wrapped module returns a view; here that warning is an error. The
    model's forward and backward, and the FSDP2-wrapped experts (efsdp 2) called directly with
    hidden states of [B, S, H], which their forward reshapes: the output is no view and equals
    the output for the same tokens given as [T, H]."""
    import warnings

    from fsdpturbo.engine import shard_model

    ids = batch(0, world)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, 3, 16, generator=g)
    index, weights = torch.tensor([[0, 5], [2, 7], [1, 1]]), torch.rand(3, 2, generator=g)
    for dispatcher in ("eager", "fused"):  # every dispatcher returns through the pipeline's `shaped_like`
        state = layout_state(world, 2, 2, 1)
        model = shard_model(build_model("qwen3_moe"), train_config(2, 2, dispatcher=dispatcher), state=state)
        experts = model.model.layers[0].mlp.experts
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=r"FSDP2-wrapped module .* returned a view tensor")
            model(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss.backward()
            out = experts(x.clone().requires_grad_(True), index, weights)
            out.sum().backward()
        assert out._base is None and out.shape == x.shape, dispatcher
        assert torch.equal(out.detach(), experts(x.view(3, 16), index, weights).detach().view(1, 3, 16)), dispatcher


def test_no_fsdp2_view_output_warning():
    run_ranks(_no_view_output_rank_fn, 4, timeout=200)


def _parse_once_rank_fn(rank, world):
    """shard_model parses the training configuration once: the parallel state (made from it
    here: none is given) and the plan read the parsed object."""
    import fsdpturbo
    from fsdpturbo import config as config_module
    from fsdpturbo.engine import shard_model

    parse, parsed = config_module._parse, []
    config_module._parse = lambda source: parsed.append(source) or parse(source)
    fsdpturbo.reset_parallel_state()
    try:
        model = shard_model(build_model("qwen3_moe"), train_config(2))
    finally:
        config_module._parse = parse
    assert len(parsed) == 1, parsed
    assert fsdpturbo.get_parallel_state().ep_size == 2
    ids = batch(0, world)
    assert torch.isfinite(model(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss)
    fsdpturbo.reset_parallel_state()


def test_shard_model_parses_the_configuration_once():
    run_ranks(_parse_once_rank_fn, 2)

def _bf16_rank_fn(rank, world):
    """bf16 storage and compute against the one-process model in bf16 and in float64
    (fsdpturbo.parity with bf16's unit roundoff), each step from the bf16 run's parameters: loss,
    every gradient element and the grad norm; then both references step with the bf16 run's
    gradients and the parameters are compared. On step 0 the gate also rejects the run's
    gradients with the experts' doubled (the comparison has teeth)."""
    from fsdpturbo import clip_grad_norm_
    from fsdpturbo.engine import shard_model
    from fsdpturbo.parity import ParityError, Reference

    state = layout_state(world, 2, None, 1)
    reference = Reference(build_model("qwen3_moe"), optimizer=lambda params: torch.optim.AdamW(params, lr=LR),
                          dtype=torch.bfloat16)
    model = shard_model(build_model("qwen3_moe"), train_config(2, bf16=True), state=state)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        reference.load({name: full(param) for name, param in model.named_parameters()})
        ids = batch(step, world)
        loss = model(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss
        loss.backward()
        gate = reference.step(loss_and_norm_step(ids), rows=world)
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)
        gate.check("loss", mean_loss / world, f"bf16 step {step}")
        grads = {f"grad {name}": full(param.grad) for name, param in model.named_parameters()}
        gate.check_all(grads, f"bf16 step {step}")
        if step == 0:
            experts = [name for name in grads if ".mlp.experts." in name]
            assert len(experts) == 4  # gate_up_proj and down_proj of both layers
            for name in experts:
                with pytest.raises(ParityError, match=name):
                    gate.check(name, grads[name] * 2, "doubled")
        gate.check("grad norm", clip_grad_norm_(model, 1.0).float(), f"bf16 step {step}")
        gate = reference.optimizer_step({name: full(param.grad) for name, param in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        gate.check_all({name: full(param) for name, param in model.named_parameters()}, f"bf16 after step {step}")


def test_bf16_training_matches_single_process_per_element_and_rejects_doubled_expert_gradients():
    run_ranks(_bf16_rank_fn, 4, timeout=200)


def _faulty_step(rank, world, fault):
    """One step of qwen3_moe at (ep 2, efsdp 2; embedding and final norm kept whole) with `fault`
    built into the engine's gradient path; returns the run's gradients and the gate."""
    from torch.distributed.fsdp import FSDPModule

    from fsdpturbo import engine, parity
    from fsdpturbo.efsdp import configure_gradient_reduction

    state = layout_state(world, 2, 2, 1)
    model = shard_model_for_faults(state)
    layers = list(model.model.layers)
    if fault == "doubled expert gradient":
        for layer in layers:
            assert isinstance(layer.mlp.experts, FSDPModule)
            configure_gradient_reduction(layer.mlp.experts, state.sub_mesh("efsdp"), world / 2)
    if fault == "wrong divide factor":  # the dense gradients divided by ep instead of the world size
        for module in layers + [model]:
            configure_gradient_reduction(module, state.sub_mesh("dp"), 2.0)
    reference = parity.Reference(build_model("qwen3_moe"))
    reference.load({name: full(param) for name, param in model.named_parameters()})
    ids = batch(0, world)
    original = engine._reduce_hook
    if fault == "missing reduction":  # the whole parameters' gradients are divided but never summed
        engine._reduce_hook = lambda grad, factor: grad / factor
    try:
        model(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss.backward()
    finally:
        engine._reduce_hook = original
    gate = reference.step(loss_and_norm_step(ids), rows=world)
    return {f"grad {name}": full(param.grad) for name, param in model.named_parameters()}, gate


def shard_model_for_faults(state):
    from fsdpturbo.engine import shard_model

    return shard_model(build_model("qwen3_moe"), train_config(2, 2, ignored=[n.removesuffix(".weight") for n in IGNORED]),
                       state=state)


IGNORED = ("model.embed_tokens.weight", "model.norm.weight")  # kept whole: reduced by engine._reduce_hook
# fault → which gradients it makes wrong: the gate must reject exactly those
FAULTS = {"missing reduction": lambda name: name in IGNORED,
          "doubled expert gradient": lambda name: ".mlp.experts." in name,
          "wrong divide factor": lambda name: ".mlp.experts." not in name and name not in IGNORED}


def _faults_rank_fn(rank, world):
    from fsdpturbo.parity import ParityError

    for fault in (None, *FAULTS):
        grads, gate = _faulty_step(rank, world, fault)
        rejected = set()
        for name, grad in grads.items():
            try:
                gate.check(name, grad, fault or "no fault")
            except ParityError:
                rejected.add(name.removeprefix("grad "))
        wrong = {name.removeprefix("grad ") for name in grads if fault and FAULTS[fault](name.removeprefix("grad "))}
        assert rejected == wrong, f"{fault or 'no fault'}: the gate rejects {sorted(rejected)}, the wrong " \
                                  f"gradients are {sorted(wrong)}"


def test_parity_gate_rejects_a_missing_reduction_a_doubled_expert_gradient_and_a_wrong_divide_factor():
    """The gate of fsdpturbo.parity has teeth: three faults built into the engine's gradient path
    (the whole parameters' all-reduce skipped, the experts' divide factor halved, the dense
    parameters divided by ep instead of the world size) are each rejected on exactly the
    gradients they make wrong, and the same run without a fault passes."""
    run_ranks(_faults_rank_fn, 4, timeout=300)


def _meta_ignored_rank_fn(rank, world, weights):
    """Parameters kept whole (`fsdp_ignored_modules`) of a model built on meta and loaded from
    `weights`: their gradients are summed over the ranks as on a real model (materialising
    replaces the parameter objects after sharding), so every gradient equals one process."""
    import fsdpturbo
    from fsdpturbo.engine import shard_model
    from fsdpturbo.parity import Reference

    reference = Reference(build_model("qwen3_moe"))
    if rank == 0:
        reference.model.save_pretrained(weights)
    dist.barrier()
    with fsdpturbo.meta_parameters():
        model = build_model("qwen3_moe")
    config = train_config(2, 2, ignored=[n.removesuffix(".weight") for n in IGNORED])
    model = shard_model(model, config, weights=weights, state=layout_state(world, 2, 2, 1))
    ids = batch(0, world)
    model(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss.backward()
    gate = reference.step(loss_and_norm_step(ids), rows=world)
    gate.check_all({f"grad {name}": full(param.grad) for name, param in model.named_parameters()}, "meta")


def test_parameters_kept_whole_of_a_meta_model_reduce_their_gradients(tmp_path):
    run_ranks(_meta_ignored_rank_fn, 4, str(tmp_path / "weights"), timeout=300)
