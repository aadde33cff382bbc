"""The Python package: loading, errors, config, patterns, and the topology against torch's
own DeviceMesh groups on gloo ranks."""
import pathlib
import tomllib

import pytest
import torch

import fsdpturbo
import fsdpturbo.ep
from dist_util import run_ranks


def test_loads_both_libraries_and_reports_the_version():
    cargo = tomllib.loads((pathlib.Path(__file__).parents[2] / "Cargo.toml").read_text())
    assert fsdpturbo.__version__ == cargo["package"]["version"]
    assert hasattr(torch.ops.fsdpturbo, "copy_slice_")


def test_config_errors_are_value_errors_with_path_and_line():
    with pytest.raises(ValueError, match=r"dist_config\.cp_size \(line 3\).*Unknown params"):
        fsdpturbo.parse_train_config("dist_config:\n  name: fsdpturbo\n  cp_size: 2\n")
    cfg = fsdpturbo.parse_train_config({"cp_size": 2, "dist_config": {"name": "fsdpturbo", "ep_size": "4"}})
    assert cfg["cp_size"] == 2 and cfg["dist"]["ep_size"] == 4 and cfg["dist"]["ep_dispatcher"] == "eager"


def test_the_parsed_config_has_every_dist_config_key_also_without_a_dist_config():
    """The dict Python receives holds every key of Rust's dist_config schema (the list its
    unknown-key error names as accepted), with the defaults of a dist_config of only its name."""
    import ast
    import re

    with pytest.raises(ValueError, match=r"Unknown params") as raised:
        fsdpturbo.parse_train_config({"dist_config": {"name": "fsdpturbo", "no_such_key": 1}})
    schema_keys = ast.literal_eval(re.search(r"Expected: (\[[^\]]*\])", str(raised.value)).group(1))
    assert len(schema_keys) > 10 and "ep_size" in schema_keys
    parsed = fsdpturbo.parse_train_config("model: m\n")
    assert sorted(parsed["dist"]) == sorted(schema_keys)
    assert parsed["dist"] == fsdpturbo.parse_train_config({"dist_config": {"name": "fsdpturbo"}})["dist"]
    capacity = fsdpturbo.parse_train_config({"dist_config": {"name": "fsdpturbo", "expert_capacity": 8}})
    assert capacity["dist"]["capacity_overflow"] == "drop"


def test_module_name_match_is_the_seeds():
    assert fsdpturbo.module_name_match("model.layers.{0-3}.mlp", "model.layers.03.mlp")
    assert not fsdpturbo.module_name_match("model.layers.{*}", "model.layers.1.2")
    with pytest.raises(ValueError, match=r"Unrecognized brace pattern: 1,2"):
        fsdpturbo.module_name_match("a.{1,2}", "a.1")


def test_topology_errors_and_global_state():
    with pytest.raises(ValueError, match=r"dp_size must be divisible by ep_size, got 12 % 8 != 0\."):
        fsdpturbo.ParallelState(12, ep_size=8)
    fsdpturbo.reset_parallel_state()
    first = fsdpturbo.initialize_parallel_state(fsdpturbo.ParallelState(16, cp_size=2, ep_size=4))
    assert fsdpturbo.initialize_parallel_state(fsdpturbo.ParallelState(16, cp_size=2, ep_size=4)) is first
    with pytest.raises(RuntimeError, match=r"already initialized with \(8, 2, 4\), got \(16, 1, 2\)\."):
        fsdpturbo.initialize_parallel_state(fsdpturbo.ParallelState(16, ep_size=2))
    fsdpturbo.reset_parallel_state()
    assert fsdpturbo.get_parallel_state() is None


def test_from_config_uses_the_yaml_topology():
    state = fsdpturbo.ParallelState.from_config("examples/configs/qwen3_5_cp2_ep4_efsdp2.yaml", 16)
    assert state.mesh_shape("expert") == (1, 2, 4, 2)
    assert state.group_ranks("expert", "ep", 3) == [1, 3, 5, 7]
    assert state.group_ranks("expert", ("efsdp", "ep"), 3) == [1, 3, 5, 7, 9, 11, 13, 15]
    sizes = {"dp_size": 4, "cp_size": 2, "mp_replicate_size": 2, "mp_shard_size": 4,
             "dist_config": {"name": "fsdpturbo", "ep_size": 2, "efsdp_size": 1}}
    state = fsdpturbo.ParallelState.from_config(sizes, 8)
    assert (state.mesh_shape("data"), state.mesh_shape("model"), state.mesh_shape("expert")) == \
        ((4, 2), (2, 4), (2, 1, 2, 2))
    with pytest.raises(ValueError, match=r"dp_size must be divisible by ep_size, got 16 % 3 != 0\."):
        fsdpturbo.ParallelState.from_config({"dist_config": {"name": "fsdpturbo", "ep_size": 3}}, 16)



def test_a_parsed_config_is_read_as_parsed():
    from fsdpturbo.config import TrainConfig

    config = TrainConfig("examples/configs/qwen3_5_cp2_ep4_efsdp2.yaml")
    assert TrainConfig.of(config) is config
    assert config.values == fsdpturbo.parse_train_config("examples/configs/qwen3_5_cp2_ep4_efsdp2.yaml")
    copy = fsdpturbo.parse_train_config(config)
    copy["dist"]["ep_size"] = 1  # a copy: the parsed object is unchanged
    assert config.values["dist"]["ep_size"] == 4
    state = fsdpturbo.ParallelState.from_config(config, 16)
    assert state.mesh_shape("expert") == (1, 2, 4, 2)

def _meshes_match_torch(rank, world, cp, ep, efsdp):
    state = fsdpturbo.ParallelState(world, cp_size=cp, ep_size=ep, efsdp_size=efsdp).init_device_meshes("cpu")
    assert state.expert_mesh.mesh_dim_names == ("edp", "efsdp", "ep", "expert_cp")
    assert tuple(state.expert_mesh.shape) == state.mesh_shape("expert")
    assert state.sub_mesh("ep").get_local_rank() == state.coordinate("expert", rank)[2]


@pytest.mark.parametrize("world,cp,ep,efsdp", [(4, 1, 2, None), (8, 2, 2, None), (8, 1, 2, 2)])
def test_device_meshes_equal_the_topology(world, cp, ep, efsdp):
    run_ranks(_meshes_match_torch, world, cp, ep, efsdp)


def test_ops_pass_opcheck():
    ops = torch.ops.fsdpturbo
    full = torch.randn(10, 6)
    local = torch.empty(3, 6)
    placements = [0, 0, 0]  # Shard(0) on a 1-D mesh of 4, coordinate 1
    torch.library.opcheck(ops.copy_slice_.default, (local, full, [4], [1], placements))
    ops.copy_slice_(local, full, [4], [1], placements)
    torch.testing.assert_close(local, full[3:6], rtol=0, atol=0)
    torch.library.opcheck(ops.scatter_slice_.default, (torch.zeros(10, 6), full[3:6].clone(), [4], [1], placements))
    grads = [torch.randn(5), torch.randn(3, 4).to(torch.bfloat16)]
    torch.library.opcheck(ops.power_sum.default, (grads, 2.0, True))
    torch.library.opcheck(ops.foreach_scale_.default, ([g.clone() for g in grads], 0.5))


def test_ops_raise_clear_errors():
    ops = torch.ops.fsdpturbo
    with pytest.raises(ValueError, match=r"local has shape \[2, 6\] but this rank's slice of \[10, 6\] has shape \[3, 6\]"):
        ops.copy_slice_(torch.empty(2, 6), torch.randn(10, 6), [4], [1], [0, 0, 0])
    with pytest.raises(ValueError, match=r"cast first"):
        ops.copy_slice_(torch.empty(3, 6, dtype=torch.float64), torch.randn(10, 6), [4], [1], [0, 0, 0])
    with pytest.raises(ValueError, match=r"float32, float64, float16 or bfloat16"):
        ops.power_sum([torch.ones(3, dtype=torch.int32)], 2.0)
    with pytest.raises(ValueError, match=r"norm_type"):
        ops.power_sum([torch.ones(3)], 0.0)


def test_seed_import_paths():
    from fsdp_turbo.distributed.expert_parallel.expert_parallel import expert_parallelize_modules
    from fsdp_turbo.fsdp_turbo_config import EPPlanConfig
    from fsdp_turbo.utils.str_match import module_name_match

    assert module_name_match("model.layers.{*}.mlp.experts", "model.layers.12.mlp.experts")
    assert EPPlanConfig(apply_modules=["x"]).dispatcher is None
    assert expert_parallelize_modules is fsdpturbo.ep.expert_parallelize_modules


def test_the_cpu_flash_attn_stand_in_stays_in_the_llamafactory_tests():
    """tests/llamafactory/site/flash_attn (FlashAttention's API on SDPA, for LlamaFactory's
    context parallelism on CPU) is on the path of the LlamaFactory tests only."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("flash_attn")
    assert spec is None or os.path.join("tests", "llamafactory") not in spec.origin, spec.origin
