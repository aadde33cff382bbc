"""The README's example ("From PyTorch") runs as written: its code block, read from README.md,
is launched by torchrun on 2 gloo ranks, with what it leaves to the reader defined before it
(the names it uses: `torch`, `dist`, `Qwen3MoeForCausalLM`, a tiny `config`, a batch `ids`),
`train.yaml` in the working directory and `/path/to/hf_checkpoint` pointed at a checkpoint of
that model; after it, each rank checks what the block claims: the HF checkpoint it saved holds
the trained model bit for bit, and the checkpoint it loaded gave back `extra` and the
scheduler's state."""
import os
import re
import subprocess
import sys

from models import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLACEHOLDER = '"/path/to/hf_checkpoint"'

PRELUDE = """\
import math
import torch
import torch.distributed as dist
from transformers import Qwen3MoeForCausalLM
from models import tiny_config
config = tiny_config("qwen3_moe")
ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
"""

EPILOGUE = """\
saved = dict(Qwen3MoeForCausalLM.from_pretrained("out/").named_parameters())
full = fsdpturbo.full_state_dict(model)
assert sorted(saved) == sorted(full), sorted(set(saved) ^ set(full))
assert all(torch.equal(saved[name].detach(), tensor) for name, tensor in full.items())
assert extra["step"] == 500 and sched.last_epoch == 1, (extra, sched.last_epoch)
assert math.isfinite(loss.item()) and math.isfinite(norm) and norm > 0, (loss, norm)
print(f"rank {dist.get_rank()}: the README example ran", flush=True)
dist.destroy_process_group()
"""


def readme_block():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    found = re.search(r"^## From PyTorch\n\n```python\n(.*?)^```", text, re.S | re.M)
    assert found, "README.md has no python block under '## From PyTorch'"
    return found.group(1)


def test_the_readme_example_runs_as_written(tmp_path):
    block = readme_block()
    assert block.count(PLACEHOLDER) == 1, f"the README block no longer names {PLACEHOLDER}"
    build_model("qwen3_moe").save_pretrained(tmp_path / "hf_checkpoint")
    (tmp_path / "train.yaml").write_text("dist_config:\n  name: fsdpturbo\n  ep_size: 2\n")
    script = tmp_path / "readme_example.py"
    script.write_text(PRELUDE + block.replace(PLACEHOLDER, repr(str(tmp_path / "hf_checkpoint"))) + EPILOGUE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert sorted(re.findall(r"rank \d: the README example ran", proc.stdout)) == [
        "rank 0: the README example ran", "rank 1: the README example ran"], proc.stdout[-3000:]
