"""FSDPTURBO_HOST_ISA from Python: `fsdpturbo.host_isa()` names the instruction set of the host
kernels; in a fresh process the variable caps it without changing a bit of the CPU ops' results,
and a value that is no instruction set is the error of the query and of the ops."""
import os
import subprocess
import sys

import fsdpturbo

NAMES = ["portable", "avx2", "avx512"]

# Prints the query's answer (or error) and a digest of a CPU grouped_mm (or its error).
CHILD = """
import hashlib, torch, fsdpturbo
try:
    print("isa", fsdpturbo.host_isa())
except fsdpturbo.FSDPTurboError as e:
    print("isa-error", type(e).__name__, e)
g = torch.Generator().manual_seed(0)
x, w = torch.randn(103, 300, generator=g), torch.randn(3, 50, 300, generator=g)
try:
    y = fsdpturbo.ops.grouped_mm(x, torch.tensor([70, 0, 33]), w)
    print("op", hashlib.sha256(y.numpy().tobytes()).hexdigest())
except (ValueError, RuntimeError) as e:
    print("op-error", type(e).__name__, e)
"""


def _child(value):
    env = {k: v for k, v in os.environ.items() if k != "FSDPTURBO_HOST_ISA"}
    if value is not None:
        env["FSDPTURBO_HOST_ISA"] = value
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    return lines


def test_the_query_names_an_instruction_set():
    assert fsdpturbo.host_isa() in NAMES  # the run's own FSDPTURBO_HOST_ISA may cap it


def test_the_variable_caps_the_instruction_set_and_changes_no_result():
    isa, op = _child(None)
    best = isa.removeprefix("isa ")
    assert best in NAMES, isa
    for name in NAMES[: NAMES.index(best) + 1]:
        assert _child(name) == [f"isa {name}", op]


def test_a_value_that_is_no_instruction_set_is_a_value_error_of_the_query_and_the_ops():
    message = ('FSDPTURBO_HOST_ISA="avx9" is not an instruction set of the host kernels: accepted are portable, '
               "avx2 and avx512 (unset or empty: the best available); this CPU and build support portable")
    isa, op = _child("avx9")
    assert isa.startswith(f"isa-error FSDPTurboValueError {message}"), isa
    assert op.startswith(f"op-error ValueError fsdpturbo::grouped_mm: {message}"), op
