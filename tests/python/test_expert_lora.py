"""LoRA on the experts (fsdpturbo.moe.expert_lora): a PEFT model with adapters on the expert weights
(`target_parameters`) and on attention (`target_modules`), sharded by `shard_model` on gloo
ranks, against the same PEFT model in one process on the whole global batch
(fsdpturbo.parity): loss, every adapter gradient, the grad norm and the adapters after AdamW
steps, element by element, with activation checkpointing and gradient accumulation; the base
weights frozen (no gradient, no optimizer state)."""
import contextlib
import pathlib
import re

import pytest
import torch
import torch.distributed as dist

import ascend_double
import models
from ascend_double import use_double
from dist_util import run_ranks
from fsdpturbo.moe import expert_lora
from models import build_model, full, layout_state, train_config

pytestmark = [pytest.mark.parity]

SEQ, MICRO_BATCHES, STEPS, LR = 6, 2, 2, 1e-3
MAX_NORM = 0.05  # below every step's grad norm: clipping scales every gradient
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def tiny_config(family):
    """models.tiny_config with moe_intermediate_size 12: no expert weight is square
    ([E, 24, 16] and [E, 16, 12]), so a transposed factor cannot pass."""
    config = models.tiny_config(family)
    config.moe_intermediate_size = 12
    return config


def build_peft_model(family="qwen3_moe", seed=0, adapter_seed=0, r=2, expert_targets=EXPERT_TARGETS):
    """The PEFT model of `family`'s tiny causal LM (base weights from `seed`): rank-`r` LoRA on
    q_proj, v_proj and the expert weights, every adapter factor random from `adapter_seed`
    (PEFT starts lora_B at zero, which would leave half the gradients zero)."""
    from peft import LoraConfig, get_peft_model


    model = build_model(family, seed, tiny_config(family))
    config = LoraConfig(r=r, lora_alpha=2 * r + 1, target_modules=["q_proj", "v_proj"],
                        target_parameters=list(expert_targets))
    model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(adapter_seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    return model


def peft_full(model, tensors):
    """Full tensors by the names of the sharded PEFT `model`, gathered, by the names and in the
    layout of the one-process PEFT model."""
    return expert_lora.to_peft(model, {name: full(t) for name, t in tensors.items()})


def test_engine_factors_reproduce_peft_delta_weight():
    """The engine's per-expert factors give PEFT's own ΔW (ParamWrapper.get_delta_weight) for
    every expert, and convert back to PEFT's matrices bitwise."""
    model = build_peft_model().double()
    experts = model.base_model.model.model.layers[0].mlp.experts
    wrappers = [experts, experts.base_layer]
    assert {w.parameter_name for w in wrappers} == {"gate_up_proj", "down_proj"}
    for wrapper in wrappers:
        lora_a, lora_b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
        num_experts = wrapper.num_experts
        down, up = expert_lora.engine_factors(lora_a, lora_b, num_experts)
        assert down.shape[:2] == up.shape[::2] == (num_experts, 2)
        delta = wrapper.scaling["default"] * torch.bmm(up, down)
        torch.testing.assert_close(delta, wrapper.get_delta_weight("default"), rtol=0, atol=1e-14)
        assert torch.equal(expert_lora.peft_lora_a(up), lora_a) and torch.equal(expert_lora.peft_lora_b(down), lora_b)


def _micro_batches(step, world):
    """[MICRO_BATCHES, world, SEQ] token ids: each rank's row of each micro-batch."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (MICRO_BATCHES, world, SEQ), generator=g)


def accumulated_step(ids):
    """The one-process reference's step: every micro-batch's whole-batch loss / MICRO_BATCHES,
    backward after each (gradient accumulation), with the batch's rows in `order`."""
    def step_fn(model, order):
        total = 0.0
        for micro in ids:
            loss = model(input_ids=micro[order], labels=micro[order]).loss / MICRO_BATCHES
            loss.backward()
            total = total + loss.detach()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return {"loss": total, "grad norm": torch.nn.utils.get_total_norm(grads)}

    return step_fn


def train_against_peft(model, reference, clip, where, steps=range(STEPS), optimizer=None):
    """AdamW steps `steps` of the sharded PEFT `model` (with `optimizer`, as a resumed run, or a
    new one; returned), MICRO_BATCHES micro-batches each (each rank forwards its own row),
    against the one-process `reference` (a `fsdpturbo.parity.Reference` of the PEFT model): each
    step starts it from the run's parameters and steps it with the run's gradients clipped by
    `clip(model, MAX_NORM)`; the loss, every adapter gradient (also after clipping, divided by
    the clipping coefficient), the grad norm and every parameter after the step through the
    parity gate; the base weights get no gradient and no optimizer state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {name for name in trainable if "lora_" in name} and \
        sum(".mlp.experts." in name for name in trainable) == 8, (where, sorted(trainable))
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in steps:
        reference.load(peft_full(model, dict(model.named_parameters())))
        ids = _micro_batches(step, world)
        losses = []
        for micro in ids:
            loss = model(input_ids=micro[rank:rank + 1], labels=micro[rank:rank + 1]).loss / MICRO_BATCHES
            loss.backward()
            losses.append(loss.detach())
        gate = reference.step(accumulated_step(ids), rows=world)
        mean_loss = torch.stack(losses).sum()
        dist.all_reduce(mean_loss)
        gate.check("loss", mean_loss / world, f"{where} step {step}")
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad), where
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        gate.check_all({f"grad {name}": g for name, g in peft_full(model, grads).items()}, f"{where} step {step}")
        norm = float(clip(model, MAX_NORM))
        gate.check("grad norm", norm, f"{where} step {step}")
        coef = MAX_NORM / (norm + 1e-6)  # what clipping multiplies every gradient by
        assert coef < 1, f"{where} step {step}: grad norm {norm} does not reach MAX_NORM: nothing clipped"
        clipped = peft_full(model, {n: p.grad for n, p in model.named_parameters() if p.requires_grad})
        gate.check_all({f"grad {name}": g / coef for name, g in clipped.items()}, f"{where} step {step} clipped")
        gate = reference.optimizer_step(clipped)
        optimizer.step()
        optimizer.zero_grad()
        assert {id(p) for p in optimizer.state} == {id(p) for p in model.parameters() if p.requires_grad}, where
        gate.check_all(peft_full(model, dict(model.named_parameters())), f"{where} after step {step}")
    return optimizer


def _assert_adapters_placed_as_their_weights(experts, where):
    """Each expert's adapter lives where the expert does: the factors of an expert weight are
    DTensors on its mesh, with its placements, holding the same experts (dim 0) on this rank."""
    for weight in expert_lora.ADAPTED_WEIGHTS:
        base = getattr(experts, weight)
        for factor in (expert_lora.down_name(weight), expert_lora.up_name(weight)):
            param = getattr(experts, factor)
            assert param.device_mesh == base.device_mesh and param.placements == base.placements, \
                (where, factor, param.placements, base.placements)
            assert param.to_local().shape[0] == base.to_local().shape[0] < base.shape[0], \
                (where, factor, param.to_local().shape, base.to_local().shape)


def _shard(model, layout, world):
    """`model` sharded at `layout` by `shard_model`, or with `llamafactory` by the engine
    LlamaFactory's fsdpturbo backend drives (`fsdpturbo.llamafactory.FSDPTurboFSDP2Engine` on
    LlamaFactory's dp mesh, its EP and EFSDP steps through the drop-in `fsdp_turbo` functions,
    EFSDP only at efsdp > 1); returns it and its grad-norm clip `(model, max_norm)`."""
    import types

    config = train_config(layout["ep"], layout.get("efsdp"), bf16=layout.get("bf16", False),
                          dispatcher=layout["dispatcher"], capacity_factor=layout.get("capacity_factor"))
    if not layout.get("llamafactory"):
        from fsdpturbo import clip_grad_norm_
        from fsdpturbo.engine import shard_model

        return shard_model(model, config, state=layout_state(world, layout["ep"], layout.get("efsdp"), 1)), \
            clip_grad_norm_
    import fsdpturbo
    from fsdpturbo.llamafactory import FSDPTurboFSDP2Engine, clip_grad_norm_

    dp_mesh = fsdpturbo.ParallelState(world).init_device_meshes("cpu").sub_mesh("dp")
    interface = types.SimpleNamespace(get_world_size=lambda dim: world, get_device_mesh=lambda dim: dp_mesh,
                                      strategy=types.SimpleNamespace(cp_size=1))  # LlamaFactory's, at cp 1
    engine = FSDPTurboFSDP2Engine(config["dist_config"], bf16=config["bf16"], dist_interface=interface)
    return engine.shard_model(model), clip_grad_norm_


def _train_rank_fn(rank, world, layouts):
    """Per layout: `train_against_peft` with activation checkpointing on (as test_train does); in
    bfloat16 storage and compute with `bf16`, against the one-process PEFT model in bfloat16."""
    from fsdpturbo.parity import Reference

    for layout in layouts:
        family = layout.get("family", "qwen3_moe")
        where = f"{family} {layout}"
        one_process = build_peft_model(family)
        if layout.get("bf16"):  # torch's CPU grouped GEMM takes no bfloat16 row of 12 (24 bytes): HF's loop
            one_process.config._experts_implementation = "eager"
        reference = Reference(one_process, optimizer=lambda params: torch.optim.AdamW(params, lr=LR),
                              dtype=torch.bfloat16 if layout.get("bf16") else torch.float32)
        model = build_peft_model(family)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model, clip = _shard(model, layout, world)
        experts = model.get_base_model().model.layers[0].mlp.experts
        # ep 1: no expert parallelism, PEFT's own wrappers stay (under the outer FSDP2)
        assert (expert_lora.expert_lora(experts) is not None) == (layout["ep"] > 1), where
        if layout["ep"] > 1:
            _assert_adapters_placed_as_their_weights(experts, where)
        if layout.get("llamafactory"):  # as LlamaFactory: EFSDP only when efsdp > 1
            assert experts.gate_up_proj.device_mesh.mesh_dim_names == \
                (("efsdp", "ep") if layout["efsdp"] > 1 else ("ep",)), where
        train_against_peft(model, reference, clip, where)


# On 4 ranks; efsdp None = dp/ep (2 with ep 2, 1 with ep 4). Capacity factor 8: room for every slot.
LAYOUTS = [dict(ep=2, dispatcher="eager"), dict(ep=4, dispatcher="fused"), dict(ep=2, efsdp=1, dispatcher="domino"),
           dict(ep=2, dispatcher="fused", capacity_factor=8.0),
           dict(ep=2, dispatcher="eager", capacity_factor=8.0, family="qwen3_5_moe"), dict(ep=1, dispatcher="eager")]


def test_expert_lora_training_equals_one_process_peft():
    """(ep 2, efsdp 2) eager, (ep 4) fused, (ep 2, efsdp 1, edp 2) domino and the capacity-bounded
    dispatch (fused; eager on Qwen3.5-MoE) on 4 ranks, and ep 1 (FSDP2 alone): the PEFT model's
    loss, every adapter gradient (experts and attention), the grad norm and every parameter
    after each AdamW step equal the one-process PEFT model's, with activation checkpointing and
    2 micro-batches of gradient accumulation; the base weights get no gradient and no optimizer
    state."""
    run_ranks(_train_rank_fn, 4, LAYOUTS, timeout=900)


@pytest.mark.parametrize("efsdp", [1, 2])
def test_llamafactory_engine_on_a_peft_model(efsdp):
    """LlamaFactory's path into our package on a PEFT model with expert adapters (its trainer hands
    the PEFT model to the backend's engine) at (ep 2, efsdp `efsdp`) on 4 ranks: as
    `test_expert_lora_training_equals_one_process_peft`, with the engine's grad-norm clip. Each
    efsdp in its own processes: LlamaFactory's parallel state is one per process."""
    layout = dict(ep=2, efsdp=efsdp, dispatcher="fused" if efsdp == 1 else "eager", llamafactory=True)
    run_ranks(_train_rank_fn, 4, [layout], timeout=600)


def _mc2_rank_fn(rank, world, layouts, log_dir):
    """`_train_rank_fn` over the CANN test doubles (mc2's fused operators on CPU tensors); the
    expert adapters' rows travel inside the fused operators only, and the doubles saw no
    violation of CANN's protocol."""
    log = pathlib.Path(log_dir) / f"rank{rank}.log"
    use_double(log)
    _mc2_equals_fused(rank, world)
    _train_rank_fn(rank, world, layouts)
    lines = log.read_text().splitlines()
    assert not [line for line in lines if line.startswith("VIOLATION")], lines
    assert not any(line.startswith("HcclAlltoAllV ") for line in lines)
    launches = [line.split()[0] for line in lines if " workspace=" in line and "GetWorkspaceSize" not in line]
    assert "aclnnAlltoAllvGroupedMatMul" in launches and "aclnnGroupedMatMulAlltoAllv" in launches, set(launches)


def _mc2_equals_fused(rank, world):
    """One step at (ep 2, efsdp 2) in bfloat16: mc2's loss and every adapter gradient equal the
    fused dispatcher's on the NPU kernels over the same doubles, bitwise."""
    from fsdpturbo.engine import shard_model

    ids = _micro_batches(0, world)[0]
    results = {}
    for dispatcher in ("fused", "mc2"):
        model = shard_model(build_peft_model(), train_config(2, bf16=True, dispatcher=dispatcher),
                            state=layout_state(world, 2, None, 1))
        loss = model(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss
        loss.backward()
        results[dispatcher] = {"loss": loss.detach(), **peft_full(
            model, {n: p.grad for n, p in model.named_parameters() if p.requires_grad})}
    differing = [n for n, t in results["fused"].items() if not torch.equal(t, results["mc2"][n])]
    assert not differing, differing


# mc2 takes bfloat16 or float16 only: against the one-process PEFT model in bfloat16.
MC2_LAYOUTS = [dict(ep=2, dispatcher="mc2", bf16=True), dict(ep=4, dispatcher="mc2", bf16=True)]


@pytest.mark.skipif(not ascend_double.BUILT, reason=ascend_double.NOT_BUILT)
def test_expert_lora_on_mc2_equals_one_process_peft(tmp_path):
    """The mc2 dispatcher (its fused all-to-all + grouped matmul operators, over the CANN test
    doubles) at (ep 2, efsdp 2) and ep 4, in bfloat16: as `test_expert_lora_training_equals_one_process_peft`."""
    run_ranks(_mc2_rank_fn, 4, MC2_LAYOUTS, str(tmp_path), timeout=900)


def turbo_config():
    """FSDPTurbo's standalone configuration at (fsdp 4, ep 2, efsdp 2), eager, with recompute: the
    patterns name the model inside the PEFT model, some with PEFT's prefix `base_model.model.`
    (read without it)."""
    from fsdp_turbo.fsdp_turbo_config import (DistributedConfig, EPPlanConfig, FSDPPlanConfig, FSDPTurboConfig,
                                              MemoryConfig)

    peft = "base_model.model."
    return FSDPTurboConfig(
        distributed=DistributedConfig(
            fully_shard_parallel_size=4, expert_parallel_size=2, expert_fully_shard_parallel_size=2,
            fsdp_plan=FSDPPlanConfig(apply_modules={f"{peft}model.layers.{{*}}": {}, "lm_head": {}},
                                     reduce_dtype="fp32", hook_modules=[f"{peft}model.layers.{{*}}.mlp"],
                                     ignored_params=[f"{peft}model.norm.weight"], pin_memory=False),
            ep_plan=EPPlanConfig(apply_modules=EXPERT_PATTERN, apply_efsdp_modules=[peft + EXPERT_PATTERN[0]],
                                 dispatcher="eager")),
        memory=MemoryConfig(recompute=True, recompute_plan=["model.layers.{*}"]))


def _fsdp_turbo_rank_fn(rank, world, tmp):
    """`FSDPTurbo(config, peft_model)` as verl's LoRA path calls it: `.model` is the PEFT model,
    its expert adapters taken over; `train_against_peft`; then the saved adapter loads with PEFT
    onto the unsharded model and gives the sharded logits, PEFT's save_pretrained is guarded,
    and a state dict in PEFT's layout (verl's, taken before wrapping) loads bitwise through
    verl's load (rank 0's values broadcast); a wrong shape is named on every rank."""
    import os

    from peft import PeftModel
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    import fsdpturbo
    from fsdp_turbo.distributed.parallel_state import reset_parallel_state
    from fsdp_turbo.fsdp_turbo import FSDPTurbo
    from fsdp_turbo.training.clip_grads import clip_grad_norm
    from fsdpturbo.parity import Reference

    reference = Reference(build_peft_model(), optimizer=lambda params: torch.optim.AdamW(params, lr=LR))
    peft_model = build_peft_model()
    peft_state = peft_model.state_dict()
    parameter_names = {name for name, _ in peft_model.named_parameters()}
    wrapper = FSDPTurbo(turbo_config(), peft_model)
    model = wrapper.model
    assert model is peft_model and expert_lora.expert_lora(model.get_base_model().model.layers[1].mlp.experts)
    train_against_peft(model, reference, lambda m, max_norm: clip_grad_norm(model=wrapper, max_norm=max_norm),
                       "FSDPTurbo")

    ids = _micro_batches(STEPS, world)[0]
    logits = _gathered_logits(model, ids)
    fsdpturbo.save_lora_adapter(model, os.path.join(tmp, "adapter"))
    unsharded = PeftModel.from_pretrained(build_model("qwen3_moe", 0, tiny_config("qwen3_moe")),
                                          os.path.join(tmp, "adapter"))
    logits_gate(unsharded, ids).check("logits", logits, "FSDPTurbo against PEFT's load of its adapter")
    with pytest.raises(RuntimeError, match="save_lora_adapter"):
        model.save_pretrained(os.path.join(tmp, "refused"))
    # verl's fsdp2_load_full_state_dict of the state dict it took before wrapping: rank 0's
    # values, the other ranks' ignored (here zeros, or nothing); then a plain load_state_dict.
    initial = {name: value for name, value in peft_state.items() if name in parameter_names}
    for others in ({}, {name: torch.zeros_like(value) for name, value in peft_state.items()}):
        set_model_state_dict(model, dict(peft_state) if rank == 0 else others,  # torch adds to the dict given
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        _assert_holds(model, initial, "set_model_state_dict(broadcast_from_rank0)")
        _perturb(model)
    wrong = dict(peft_state)
    key = next(k for k in wrong if k.endswith("experts.base_layer.lora_A.default.weight"))
    wrong[key] = wrong[key][:-1]
    with pytest.raises(ValueError, match=rf"{re.escape(key)} has shape .* takes "):  # on every rank
        set_model_state_dict(model, wrong if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    reset_parallel_state()


def _assert_holds(model, expected, how):
    """Every parameter of the sharded PEFT `model`, gathered in PEFT's names and layout, equals
    `expected` bitwise."""
    _assert_equal(peft_full(model, dict(model.named_parameters())), expected, how)


def _adapters(model):
    """The adapters of the sharded PEFT `model` (its trainable parameters), gathered, by the names
    and in the layout of the one-process PEFT model."""
    return peft_full(model, {n: p for n, p in model.named_parameters() if p.requires_grad})


def _assert_equal(got, expected, how):
    """The dicts of tensors `got` and `expected` hold the same names and are equal bitwise."""
    assert got.keys() == expected.keys(), (how, sorted(set(got) ^ set(expected)))
    differing = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert not differing, (how, differing[:3])


def _perturb(model):
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)


def test_fsdp_turbo_on_a_peft_model(tmp_path):
    """The standalone API on the PEFT model at (fsdp 4, ep 2, efsdp 2), with recompute and
    gradient accumulation, against the one-process PEFT model."""
    run_ranks(_fsdp_turbo_rank_fn, 4, str(tmp_path), timeout=300)


def _gathered_logits(model, ids):
    """The logits of every rank's row of `ids` [world, SEQ] (each rank forwards its own), [world, SEQ, V]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        logits = model(input_ids=ids[rank:rank + 1]).logits
    out = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(out, logits.contiguous())
    return torch.cat(out)


def logits_gate(one_process, ids, adapters=True):
    """The parity gate of the one-process PEFT model's logits on the batch `ids` (without
    `adapters`: under PEFT's `disable_adapter()`)."""
    from fsdpturbo.parity import Reference

    def step_fn(model, order):
        with torch.no_grad(), contextlib.nullcontext() if adapters else model.disable_adapter():
            return {"logits": model(input_ids=ids[order]).logits[torch.argsort(order)]}

    return Reference(one_process).step(step_fn, rows=ids.size(0))


def _peft_optimizer_state(model, optimizer):
    """{"<state key> <PEFT name>": full tensor} of `optimizer` over the sharded PEFT `model`, the
    moments in the one-process PEFT model's layout (so comparable across layouts)."""
    names = expert_lora.peft_names(model)
    out = {}
    for name, param in model.named_parameters():
        if param not in optimizer.state:
            continue
        peft = names.get(name, expert_lora.PeftName(name))
        for key, value in optimizer.state[param].items():
            value = full(value).clone()  # AdamW steps its plain `step` tensor in place
            out[f"{key} {peft.name}"] = peft.to_peft(value) if value.dim() else value
    return out


# Where adapters and training checkpoints saved at (ep 2, efsdp 2) are loaded, on 4 ranks: ep 1
# (FSDP2 alone, PEFT's own wrappers), ep 2 × edp 2, ep 4 and (ep 2, efsdp 2) itself.
SAVED_AT = dict(ep=2, efsdp=2, dispatcher="eager")
LOAD_LAYOUTS = [dict(ep=1, dispatcher="eager"), dict(ep=2, efsdp=1, dispatcher="fused"),
                dict(ep=4, dispatcher="eager"), SAVED_AT]


def _wrong_adapters(tmp, adapter_dir, rank):
    """Directories beside `adapter_dir` that do not fit its model, with the error each raises in
    `load_lora_adapter`: an expert factor of the wrong shape or missing (naming the tensor), and
    the config's rank r = 4 (naming the setting)."""
    import os

    from safetensors.torch import load_file, save_file

    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = f.read()
    key = next(k for k in saved if ".mlp.experts.base_layer.lora_A" in k)
    wrong = {"shape": (config, {**saved, key: saved[key][:-1]}, ValueError, re.escape(repr(key))),
             "missing": (config, {k: v for k, v in saved.items() if k != key}, KeyError, re.escape(key)),
             "rank": (config.replace('"r": 2', '"r": 4'), saved, ValueError, "has r = 4")}
    refusals = []
    for name, (text, tensors, error, match) in wrong.items():
        path = os.path.join(tmp, f"wrong_{name}")
        if rank == 0:
            os.makedirs(path)
            with open(os.path.join(path, "adapter_config.json"), "w") as f:
                f.write(text)
            save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        refusals.append((path, error, match))
    dist.barrier()
    return refusals


def _adapters_rank_fn(rank, world, tmp):
    """Trained one step at (ep 2, efsdp 2), the adapter saved (PEFT's format) and the merged
    weights saved; PEFT's own save_pretrained refused without a full state dict and equal to
    save_lora_adapter with one; then PEFT loads the adapter onto the unsharded model and
    reproduces the sharded logits, and the merged checkpoint does too. At every layout of
    LOAD_LAYOUTS a model with other adapters takes that adapter and one PEFT's save_pretrained
    wrote of a one-process model (load_lora_adapter): its adapters equal the file's bitwise
    (a copy) and its logits the one-process PEFT model's with that adapter (the parity gate);
    adapters that do not fit are refused, naming the tensor or the setting, and leave the
    model's adapters as they were."""
    import os

    from peft import PeftModel
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    import fsdpturbo

    adapter_dir, merged_dir, peft_dir = (os.path.join(tmp, d) for d in ("adapter", "merged", "by_peft"))
    ids = _micro_batches(0, world)[0]
    model, _ = _shard(build_peft_model(), SAVED_AT, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    logits = _gathered_logits(model, ids)
    adapter = _adapters(model)
    fsdpturbo.save_lora_adapter(model, adapter_dir)
    fsdpturbo.save_merged_weights(model, merged_dir)

    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    # PEFT's own save_pretrained: refused without a full state dict (PEFT's selection would drop
    # the expert adapters); with one, gathered as LlamaFactory's fsdp2 save does and written by
    # rank 0, the same file as save_lora_adapter's.
    with pytest.raises(RuntimeError, match="save_lora_adapter"):
        model.save_pretrained(os.path.join(tmp, "refused"))
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True))
    if rank == 0:
        model.save_pretrained(os.path.join(tmp, "pretrained"), state_dict=full_state)
    dist.barrier()
    by_peft = load_file(os.path.join(tmp, "pretrained", "adapter_model.safetensors"))
    assert by_peft.keys() == saved.keys() and all(torch.equal(by_peft[k], saved[k]) for k in saved), sorted(by_peft)
    assert {k.replace("lora_A.weight", "lora_A.default.weight").replace("lora_B.weight", "lora_B.default.weight")
            for k in saved} == set(adapter), sorted(saved)
    unsharded = PeftModel.from_pretrained(build_model("qwen3_moe", 0, tiny_config("qwen3_moe")), adapter_dir)
    gate = logits_gate(unsharded, ids)
    gate.check("logits", logits, "sharded model against PEFT's load of its adapter")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    gate.check("logits", _local_logits(merged, ids), "the merged checkpoint")

    one_process = build_peft_model(adapter_seed=2)  # never sharded: PEFT's own save_pretrained
    if rank == 0:
        one_process.save_pretrained(peft_dir)
    dist.barrier()
    sources = {"save_lora_adapter at (ep 2, efsdp 2)": (adapter_dir, adapter, gate),
               "PEFT's save_pretrained of one process": (
                   peft_dir, {n: p.detach().clone() for n, p in one_process.named_parameters() if p.requires_grad},
                   logits_gate(one_process, ids))}
    refusals = _wrong_adapters(tmp, adapter_dir, rank)
    for layout in LOAD_LAYOUTS:
        other, _ = _shard(build_peft_model(adapter_seed=1), layout, world)
        assert (expert_lora.expert_lora(other.get_base_model().model.layers[0].mlp.experts) is not None) == \
            (layout["ep"] > 1), layout
        for what, (path, expected, source_gate) in sources.items():
            where = f"{layout}: {what}"
            fsdpturbo.load_lora_adapter(other, path)
            _assert_equal(_adapters(other), expected, where)
            source_gate.check("logits", _gathered_logits(other, ids), where)
        held = _adapters(other)
        for path, error, match in refusals:
            with pytest.raises(error, match=match):
                fsdpturbo.load_lora_adapter(other, path)
            _assert_equal(_adapters(other), held, f"{layout}: after refusing {path}")


def _local_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_adapter_out_and_in_at_any_layout(tmp_path):
    """`_adapters_rank_fn`: saved at (ep 2, efsdp 2), and by PEFT from one process; loaded at
    ep 1, ep 2 × edp 2, ep 4 and (ep 2, efsdp 2)."""
    run_ranks(_adapters_rank_fn, 4, str(tmp_path), timeout=600)


def _resume_rank_fn(rank, world, tmp):
    """Training resumed at another layout: one AdamW step at (ep 2, efsdp 2) against the
    one-process PEFT model (`train_against_peft`), the DCP checkpoint saved (adapters, frozen
    weights, AdamW moments and step), then the uninterrupted run's next steps. At each layout
    of LOAD_LAYOUTS with ep > 1 a model with other adapters and a new optimizer loads the
    checkpoint: its adapters and moments equal the saved ones bitwise (a copy, in PEFT's
    layout), and its next steps pass the same parity gate as the uninterrupted run's, against
    the one-process PEFT model resumed from where the saving run left it; at (ep 2, efsdp 2)
    the resumed run equals the uninterrupted one bitwise. At ep 1 (PEFT's own wrappers, its
    names and folded layout, under FSDP2) the checkpoint is refused, naming the tensors it
    lacks, and the model is left as it was: across ep 1 adapters move as a PEFT adapter
    directory (`_adapters_rank_fn`)."""
    import copy
    import os

    import fsdpturbo
    from fsdpturbo.checkpoint import CheckpointError
    from fsdpturbo.parity import Reference

    ckpt_dir = os.path.join(tmp, "ckpt")
    reference = Reference(build_peft_model(), optimizer=lambda params: torch.optim.AdamW(params, lr=LR))
    model, clip = _shard(build_peft_model(), SAVED_AT, world)
    optimizer = train_against_peft(model, reference, clip, f"saving run {SAVED_AT}", steps=range(1))
    fsdpturbo.save_checkpoint(model, optimizer, ckpt_dir)
    at_save = _adapters(model), _peft_optimizer_state(model, optimizer)
    reference_at_save = copy.deepcopy(reference)  # the one-process model and both AdamWs, after step 0
    train_against_peft(model, reference, clip, "uninterrupted run", steps=range(1, STEPS), optimizer=optimizer)
    uninterrupted = _adapters(model), _peft_optimizer_state(model, optimizer)
    for layout in LOAD_LAYOUTS:
        where = f"resumed at {layout}"
        resumed, clip = _shard(build_peft_model(adapter_seed=1), layout, world)
        resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=LR)
        if layout["ep"] == 1:
            before = _adapters(resumed)
            with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \[.*experts\.base_layer\."):
                fsdpturbo.load_checkpoint(resumed, resumed_optimizer, ckpt_dir)
            _assert_equal(_adapters(resumed), before, f"{where}: after the refusal")
            continue
        fsdpturbo.load_checkpoint(resumed, resumed_optimizer, ckpt_dir)
        _assert_equal(_adapters(resumed), at_save[0], f"{where}: adapters")
        _assert_equal(_peft_optimizer_state(resumed, resumed_optimizer), at_save[1], f"{where}: AdamW state")
        train_against_peft(resumed, copy.deepcopy(reference_at_save), clip, where, steps=range(1, STEPS),
                           optimizer=resumed_optimizer)
        if layout is SAVED_AT:
            _assert_equal(_adapters(resumed), uninterrupted[0], f"{where}: adapters against the uninterrupted run")
            _assert_equal(_peft_optimizer_state(resumed, resumed_optimizer), uninterrupted[1],
                          f"{where}: AdamW state against the uninterrupted run")


def test_training_resumed_at_another_layout(tmp_path):
    run_ranks(_resume_rank_fn, 4, str(tmp_path), timeout=600)


def loss_step(ids):
    def step_fn(model, order):
        loss = model(input_ids=ids[order], labels=ids[order]).loss
        loss.backward()
        return {"loss": loss}

    return step_fn


EXPERT_PATTERN = ["model.layers.{*}.mlp.experts"]


def _drop_in_rank_fn(rank, world):
    """The seed's entry point on the model inside a PEFT model, as LlamaFactory's engine calls
    it (`fsdp_turbo...expert_parallelize_modules`, expert parallelism alone): the loss and the
    expert adapters' gradients equal the one-process PEFT model's; PEFT's `disable_adapter()`
    turns the expert adapters off (the logits are the base model's, and the logits with the
    adapters are rejected against them); a user's callable dispatcher and a second adapter on
    the experts are refused, naming the module."""
    import fsdpturbo
    from fsdp_turbo.distributed.expert_parallel.expert_parallel import expert_parallelize_modules
    from fsdp_turbo.fsdp_turbo_config import EPPlanConfig
    from fsdpturbo.parity import ParityError, Reference

    ep_mesh = fsdpturbo.ParallelState(world, ep_size=world).init_device_meshes("cpu").sub_mesh("ep")
    reference = Reference(build_peft_model())
    model = build_peft_model()
    expert_parallelize_modules(model.get_base_model(), ep_mesh,
                               EPPlanConfig(apply_modules=EXPERT_PATTERN, dispatcher="fused"))
    ids = _micro_batches(0, world)[0]
    loss = model(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss
    loss.backward()
    gate = reference.step(loss_step(ids), rows=world)
    dist.all_reduce(mean := loss.detach().clone())
    gate.check("loss", mean / world, "drop-in")
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad and ".mlp.experts." in n}
    assert len(grads) == 8
    gate.check_all({f"grad {n}": g for n, g in peft_full(model, grads).items()}, "drop-in")

    with model.disable_adapter():
        without = _gathered_logits(model, ids)
    base_gate = logits_gate(build_peft_model(), ids, adapters=False)
    base_gate.check("logits", without, "disable_adapter()")
    with pytest.raises(ParityError):
        base_gate.check("logits", _gathered_logits(model, ids), "adapters on")

    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts has LoRA adapters .* dispatchers \['domino', "
                                         r"'eager', 'fused', 'mc2'\]"):  # a user's callable does not apply them
        expert_parallelize_modules(build_peft_model().get_base_model(), ep_mesh,
                                   EPPlanConfig(apply_modules=EXPERT_PATTERN, dispatcher=lambda *args: None))
    two = build_peft_model()  # PEFT's add_adapter refuses a second adapter on parameters; its layer API does not
    two.get_base_model().model.layers[0].mlp.experts.update_layer("second", 2, lora_alpha=4, lora_dropout=0.0,
                                                                  init_lora_weights=True, use_rslora=False)
    with pytest.raises(ValueError, match=r"holds the LoRA adapters \['default', 'second'\]"):
        expert_parallelize_modules(two.get_base_model(), ep_mesh,
                                   EPPlanConfig(apply_modules=EXPERT_PATTERN, dispatcher="eager"))


def test_drop_in_entry_point_disable_adapter_and_refusals():
    run_ranks(_drop_in_rank_fn, 2, timeout=300)


def _compiled_rank_fn(rank, world):
    """The capacity-bounded dispatch with expert LoRA compiled whole (inductor): loss and every
    adapter gradient against the one-process PEFT model; no graph break but FSDP2's hooks."""
    from graph_breaks import FSDP_HOOKS, graph_breaks

    from fsdpturbo.engine import shard_model
    from fsdpturbo.parity import Reference

    reference = Reference(build_peft_model())
    model = shard_model(build_peft_model(), train_config(2, dispatcher="fused", capacity_factor=8.0),
                        state=layout_state(world, 2, None, 1))
    ids = _micro_batches(0, world)[0]
    loss = torch.compile(model)(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1], use_cache=False).loss
    loss.backward()
    gate = reference.step(loss_step(ids), rows=world)
    dist.all_reduce(mean := loss.detach().clone())
    gate.check("loss", mean / world, "compiled")
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    gate.check_all({f"grad {n}": g for n, g in peft_full(model, grads).items()}, "compiled")
    explained = torch._dynamo.explain(model)(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1], use_cache=False)
    assert graph_breaks(explained) <= {FSDP_HOOKS}, graph_breaks(explained)


def test_compiled_capacity_mode_with_expert_lora():
    run_ranks(_compiled_rank_fn, 2, timeout=900)
