"""`pip install ./torch_ext` builds through the project's CMake and gives a package that works
outside the source tree, with no environment variables pointing at the build."""
import os
import pathlib
import subprocess
import sys
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_pip_install_from_torch_ext(tmp_path):
    target = tmp_path / "site"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDPTURBO_") and k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                    "--disable-pip-version-check", "--target", str(target), str(REPO / "torch_ext")],
                   check=True, env=env, cwd=tmp_path)
    probe = ("import fsdpturbo, fsdpturbo.llamafactory, torch; "
             "import fsdp_turbo.distributed.expert_parallel.expert_fully_shard_parallel; "
             "import fsdp_turbo.fsdp_turbo, fsdp_turbo.distributed.parallel_state, fsdp_turbo.training.clip_grads; "
             "assert fsdpturbo._native.LIB_PATH.parent.parent.parent == __import__('pathlib').Path(%r); "
             "x = torch.arange(10.); y = torch.empty(3); "
             "fsdpturbo.ops.copy_slice_(y, x, [4], [2], [0, 0, 0]); "
             "assert y.tolist() == [6., 7., 8.]; print(fsdpturbo.__version__)") % str(target)
    out = subprocess.run([sys.executable, "-c", probe], check=True, env={**env, "PYTHONPATH": str(target)},
                         cwd=tmp_path, capture_output=True, text=True)
    assert out.stdout.strip() == tomllib.loads((REPO / "Cargo.toml").read_text())["package"]["version"]
    assert sorted(p.name for p in (target / "fsdpturbo" / "lib").iterdir()) == [
        "libfsdpturbo.so.0", "libfsdpturbo_torch.so"]
