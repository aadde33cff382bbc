"""The LlamaFactory integration layer (`fsdpturbo.llamafactory`): the seed's own tests
where they apply, constructors that touch no mesh, and the engine end to end
on gloo ranks against the single-process model and torch's clip_grad_norm_."""
import types

import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks
from models import SEQ, batch, build_model, full, positions, rank_loss

# also run against LlamaFactory's transformers; and on the other instruction sets (ctest parity_*)
pytestmark = [pytest.mark.transformers_5_8, pytest.mark.parity]


class _Model(torch.nn.Module):
    def __init__(self, model_type):
        super().__init__()
        self.config = types.SimpleNamespace(model_type=model_type)
        self.linear = torch.nn.Linear(2, 2)


def test_qwen35_ep_model_spec():
    from fsdpturbo.llamafactory import FSDPTurboEPModelSpec

    spec = FSDPTurboEPModelSpec.get(_Model("qwen3_5_moe"))
    assert spec.ep_modules == ["model.language_model.layers.{*}.mlp.experts"]
    assert spec.ep_fsdp_modules == ["model.language_model.layers.{*}.mlp"]
    assert FSDPTurboEPModelSpec.get(torch.nn.Linear(2, 2)) is None
    assert FSDPTurboEPModelSpec.get(_Model("llama")) is None


def test_spec_register_returns_the_function_and_feeds_the_plan():
    from fsdpturbo.llamafactory import FSDPTurboEPModelSpec
    from fsdpturbo.spec import get_ep_fsdp_modules
    from fsdpturbo.spec import get_model_spec

    def prepare(model):
        model.prepared = True
        return model

    assert FSDPTurboEPModelSpec.register("tiny_moe_test", ["blocks.{*}.moe.experts"])(prepare) is prepare
    spec = FSDPTurboEPModelSpec.get(_Model("tiny_moe_test"))
    assert spec.prepare(_Model("tiny_moe_test")).prepared
    assert get_model_spec("tiny_moe_test")["ep_modules"] == ["blocks.{*}.moe.experts"]
    assert get_ep_fsdp_modules(spec) == ["blocks.{*}.moe"]


def test_qwen3_moe_prepare_adds_hidden_size():
    from fsdpturbo.llamafactory import FSDPTurboEPModelSpec

    model = build_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    assert not hasattr(experts, "hidden_size")
    FSDPTurboEPModelSpec.get(model).prepare(model)
    assert experts.hidden_size == experts.hidden_dim == 16


def test_storage_dtype_is_set_inside_the_backend(monkeypatch):
    from fsdpturbo.llamafactory import engine as engine_module
    from fsdpturbo.llamafactory import FSDPTurboFSDP2Engine

    monkeypatch.setattr(engine_module.FSDP2Engine, "shard_model", lambda self, model: model)
    for bf16, dtype in [(True, torch.bfloat16), (False, torch.float32)]:
        engine = FSDPTurboFSDP2Engine({"name": "fsdpturbo"}, bf16=bf16)
        model = engine.shard_model(torch.nn.Linear(2, 2, dtype=torch.float64))
        assert model.weight.dtype == dtype


class _DataMesh:
    """LlamaFactory's data mesh (dp, cp), reduced to its size."""

    def __init__(self, dp, cp):
        self.size = lambda: dp * cp


class _DpMesh:
    """LlamaFactory's dp mesh, reduced to its root: the data mesh."""

    def __init__(self, dp, cp):
        self._get_root_mesh = lambda: _DataMesh(dp, cp)


@pytest.mark.parametrize("cp", [1, 2])
def test_efsdp_gradient_divide_factor_and_call_time_lookups(monkeypatch, cp):
    """The divide factor is dp · cp, from the Rust plan on the parallel state's topology (the
    seed's test: 8 with ep 4 · efsdp 2 and cp 1); the EP and EFSDP functions are looked up on
    their fsdp_turbo modules when the engine runs; the outer FSDP2 ignores the experts."""
    from fsdp_turbo.distributed.expert_parallel import expert_fully_shard_parallel, expert_parallel
    from fsdpturbo.llamafactory import FSDPTurboFSDP2Engine, FSDPTurboParallelState
    from fsdpturbo.llamafactory import state as state_module

    calls = []

    def record(name):
        def fn(model, mesh, ep_plan, fsdp_plan=None):
            calls.append((name, mesh, ep_plan, fsdp_plan))
            return model
        return fn

    monkeypatch.setattr(expert_parallel, "expert_parallelize_modules", record("ep"))
    monkeypatch.setattr(expert_fully_shard_parallel, "expert_fully_shard_modules", record("efsdp"))
    monkeypatch.setattr(state_module, "init_device_mesh", lambda **kwargs: _FakeMesh())
    state = FSDPTurboParallelState().initialize(_Interface(8, cp, _FakeMesh()), {"name": "fsdpturbo", "ep_size": 4})
    monkeypatch.setattr(state_module, "get_fsdpturbo_parallel_state", lambda: state)
    engine = FSDPTurboFSDP2Engine({"name": "fsdpturbo", "ep_size": 4, "ep_dispatcher": "eager"}, dp_mesh=_DpMesh(8, cp))
    model = build_model("qwen3_moe")
    returned, ignored = engine.prepare_model_ep(model)
    assert returned is model
    assert ignored == {p for name, p in model.named_parameters() if ".mlp.experts." in name}
    assert [c[0] for c in calls] == ["ep", "efsdp"]
    assert calls[0][1] == ("sub", "ep") and calls[1][1] == ("sub", "efsdp")
    ep_plan, fsdp_plan = calls[1][2], calls[1][3]
    assert ep_plan.gradient_divide_factor == 8.0 * cp == engine.gradient_divide_factor()
    assert ep_plan.apply_modules == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert ep_plan.apply_efsdp_modules == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert fsdp_plan.apply_modules == {} and fsdp_plan.fsdp_implementation == "native"


def test_missing_spec_raises_also_with_ep_size_one():
    from fsdpturbo.llamafactory import FSDPTurboFSDP2Engine

    engine = FSDPTurboFSDP2Engine({"name": "fsdpturbo", "ep_size": 1}, bf16=False, dp_mesh=object())
    with pytest.raises(ValueError, match="No FSDPTurbo EP spec is registered for model_type=llama."):
        engine.prepare_model_ep(_Model("llama"))


def test_constructors_touch_no_mesh_and_configs_are_mutable():
    from fsdp_turbo.fsdp_turbo_config import EPPlanConfig, FSDPPlanConfig
    from fsdpturbo.llamafactory import FSDPTurboFSDP2Engine, FSDPTurboParallelState

    engine = FSDPTurboFSDP2Engine({"name": "fsdpturbo", "ep_size": 4, "ep_dispatcher": "fused"}, bf16=True,
                                  dist_interface=object(), dp_mesh=object())
    assert engine.config.values["bf16"] and engine.config.values["dist"]["ep_size"] == 4
    # The dict is validated by the Rust core when the engine is made.
    with pytest.raises(ValueError, match=r"dist_config\.ep_size \(line 1\): ep_size must be positive, got 0\."):
        FSDPTurboFSDP2Engine({"name": "fsdpturbo", "ep_size": 0})
    with pytest.raises(ValueError, match=r"dist_config\.ep_dispatcher .*Unsupported dispatcher ring"):
        FSDPTurboFSDP2Engine({"name": "fsdpturbo", "ep_dispatcher": "ring"})
    state = FSDPTurboParallelState()
    assert not state.initialized and state.ep_mesh is None and state.efsdp_size == 1
    plan = EPPlanConfig(apply_modules=["model.layers.{*}.mlp.experts"], dispatcher="eager",
                        apply_efsdp_modules=["model.layers.{*}.mlp"])
    plan.gradient_divide_factor = 8.0
    assert plan.gradient_divide_factor == 8.0
    fsdp_plan = FSDPPlanConfig(apply_modules={}, hook_modules=["model.layers.{*}.mlp"], fsdp_implementation="native")
    fsdp_plan.hook_modules = []
    assert fsdp_plan.apply_modules == {} and fsdp_plan.ignored_modules == []


class _FakeMesh:
    device_type = "cpu"

    def __getitem__(self, name):
        return ("sub", name)


class _Interface:
    def __init__(self, dp, cp, mesh):
        self.dp, self.mesh = dp, mesh
        self.strategy = types.SimpleNamespace(cp_size=cp)

    def get_world_size(self, dim):
        return self.dp

    def get_device_mesh(self, dim):
        return self.mesh if dim == "dp" else None


def test_parallel_state_owns_the_expert_mesh(monkeypatch):
    from fsdpturbo.llamafactory import FSDPTurboParallelState
    from fsdpturbo.llamafactory import state as state_module

    calls = []

    def init_device_mesh(*args, **kwargs):
        calls.append((args, kwargs))
        return _FakeMesh()

    monkeypatch.setattr(state_module, "init_device_mesh", init_device_mesh)
    state = FSDPTurboParallelState()
    state.initialize(_Interface(16, 1, _FakeMesh()), {"name": "fsdpturbo", "ep_size": 8})
    assert calls == [((), {"device_type": "cpu", "mesh_shape": (1, 2, 8, 1),
                           "mesh_dim_names": ("edp", "efsdp", "ep", "expert_cp")})]
    assert state.topology.mesh_shape("expert") == (1, 2, 8, 1) and state.topology.world_size == 16
    assert (state.ep_mesh, state.efsdp_mesh, state.expert_cp_mesh) == (("sub", "ep"), ("sub", "efsdp"),
                                                                       ("sub", "expert_cp"))
    state.initialize(_Interface(16, 1, _FakeMesh()), {"name": "fsdpturbo", "ep_size": 8})
    assert len(calls) == 1
    with pytest.raises(RuntimeError, match=r"already initialized with \(16, 1, 8\), got \(16, 1, 4\)"):
        state.initialize(_Interface(16, 1, _FakeMesh()), {"name": "fsdpturbo", "ep_size": 4})
    replicated = FSDPTurboParallelState().initialize(_Interface(16, 1, _FakeMesh()),
                                                     {"name": "fsdpturbo", "ep_size": 4, "efsdp_size": 2})
    assert (replicated.edp_size, replicated.efsdp_size) == (2, 2)
    assert calls[-1][1]["mesh_shape"] == (2, 2, 4, 1)


def test_parallel_state_errors():
    from fsdpturbo.llamafactory import FSDPTurboParallelState, clip_grad_norm_

    with pytest.raises(ValueError, match="ep_size must be positive, got 0."):
        FSDPTurboParallelState().initialize(_Interface(4, 1, _FakeMesh()), {"name": "fsdpturbo", "ep_size": 0})
    with pytest.raises(ValueError, match=r"dp_size must be divisible by ep_size, got 4 % 3 != 0."):
        FSDPTurboParallelState().initialize(_Interface(4, 1, _FakeMesh()), {"name": "fsdpturbo", "ep_size": 3})
    with pytest.raises(RuntimeError, match="requires an initialized distributed device mesh"):
        FSDPTurboParallelState().initialize(_Interface(4, 1, None), {"name": "fsdpturbo", "ep_size": 2})
    with pytest.raises(RuntimeError, match="must be initialized before clipping gradients"):
        clip_grad_norm_(torch.nn.Linear(2, 2), 1.0)


class _RealInterface:
    """LlamaFactory's DistributedInterface, reduced to what the backend reads, on real meshes."""

    def __init__(self, state):
        self.state = state
        self.strategy = types.SimpleNamespace(cp_size=state.cp_size)

    def get_world_size(self, dim):
        return self.state.size(dim)

    def get_device_mesh(self, dim):
        return self.state.sub_mesh(dim)


def _engine_rank_fn(rank, world, ep, init, cp):
    """With cp > 1 each data-parallel rank's sequence is split over its CP group (test_train's
    Ulysses), whose loss convention is LlamaFactory's `sequence_parallel_loss`'s."""
    import fsdpturbo
    import ulysses
    from fsdpturbo.llamafactory import FSDPTurboFSDP2Engine, clip_grad_norm_
    from fsdpturbo.weights import meta_parameters

    base = fsdpturbo.ParallelState(world, cp_size=cp).init_device_meshes("cpu")  # LlamaFactory's data and model meshes
    interface = _RealInterface(base)
    from fsdpturbo.parity import Reference

    reference = Reference(build_model("qwen3_moe"))
    weights = None
    if init == "meta":
        import os
        import tempfile

        weights = os.path.join(tempfile.gettempdir(), f"fsdpturbo_lf_{os.getppid()}")
        if rank == 0:
            reference.model.save_pretrained(weights)
        dist.barrier()
        with meta_parameters():
            model = build_model("qwen3_moe")
    else:
        model = build_model("qwen3_moe")
    ignored = ["model.norm"] if init == "default" else []
    engine = FSDPTurboFSDP2Engine({"name": "fsdpturbo", "ep_size": ep, "ep_dispatcher": "eager",
                                   "fsdp_ignored_modules": ignored}, bf16=False, dist_interface=interface, weights=weights)
    model = engine.shard_model(model)
    if cp > 1:
        ulysses.install(model, base.sub_mesh("cp").get_group())
    from torch.distributed.tensor import DTensor

    assert isinstance(model.model.norm.weight, DTensor) != bool(ignored)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    # As in LlamaFactory: EFSDP only when efsdp > 1; with efsdp = 1 EP alone reduces the experts.
    dp = world // cp
    assert experts.device_mesh.mesh_dim_names == (("efsdp", "ep") if ep < dp else ("ep",))
    ids = batch(0, world).view(dp, cp * SEQ)
    rank_loss(model, base, "qwen3_moe", ids).backward()
    position_ids = {"position_ids": positions("qwen3_moe", dp, cp * SEQ)}

    def step_fn(ref, order):
        ref(input_ids=ids[order], labels=ids[order], **position_ids).loss.backward()
        return {"grad norm": torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)}

    gate = reference.step(step_fn, rows=dp)
    norm = clip_grad_norm_(model, 0.1)
    assert isinstance(norm, float)
    gate.check("grad norm", norm)
    gate.check_all({f"grad {name}": full(param.grad) for name, param in model.named_parameters()}, "clipped")


@pytest.mark.parametrize("ep,init,cp", [(2, "meta", 1), (4, "default", 1), (2, "default", 2)])
def test_engine_gradients_and_clip_equal_single_process(ep, init, cp):
    run_ranks(_engine_rank_fn, 4, ep, init, cp, timeout=200)
