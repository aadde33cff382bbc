"""Launch robustness: a rank launched with another configuration or model makes every rank
raise the same clear error (never a hang until the process-group timeout); a training
configuration path that does not exist is reported as a missing file."""
import pytest
import torch.distributed as dist

from dist_util import run_ranks
from models import build_model, train_config
from blocks import moe_block

pytestmark = pytest.mark.transformers_5_8  # also run against LlamaFactory's transformers


def _expect_mismatch(call, field, ranks):
    with pytest.raises(ValueError) as error:
        call()
    text = str(error.value)
    assert f"the ranks disagree on the {field}" in text and f"rank(s) {ranks} differ" in text, text


def _mismatch_rank_fn(rank, world):
    import fsdpturbo
    from fsdpturbo.ep import EPPlanConfig, expert_parallelize_modules

    # One rank with ep_size 4 where the others have 2: every rank raises in shard_model.
    config = train_config(ep=4 if rank == 3 else 2)
    _expect_mismatch(lambda: fsdpturbo.shard_model(build_model("qwen3_moe"), config), "training configuration", [3])
    assert fsdpturbo.get_parallel_state() is None, "no meshes were built before the check"
    # The drop-in entry point: one rank's model has 16 experts instead of 8.
    state = fsdpturbo.ParallelState(world, ep_size=2).init_device_meshes("cpu")
    block = moe_block(16 if rank == 1 else 8, 2, __import__("torch").float32)
    _expect_mismatch(lambda: expert_parallelize_modules(block, state.sub_mesh("ep"),
                                                        EPPlanConfig(apply_modules=["experts"], dispatcher="eager")),
                     "model structure", [1])
    dist.barrier()  # and the ranks still talk to each other


def test_a_rank_with_another_config_or_model_fails_on_every_rank_without_hanging():
    run_ranks(_mismatch_rank_fn, 4, timeout=120)


def test_a_missing_training_config_is_a_missing_file():
    from fsdpturbo.config import parse_train_config

    with pytest.raises(FileNotFoundError, match=r"'/nonexistent/train.yaml' does not exist"):
        parse_train_config("/nonexistent/train.yaml")
    assert parse_train_config("bf16: true")["bf16"] is True  # YAML text is still YAML text
