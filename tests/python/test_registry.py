"""The device-operator registry (docs/kernels.md) through the Python package and
the `fsdp_turbo.ops` compatibility paths: exact match, the CPU fallback warned once, silent
replacement, the seed's KeyErrors, name checks, the default device without starting CUDA, and
one registry shared with the C ABI. Each test uses its own operator names (the registry is
process-wide)."""
import ctypes
import logging
import os
import subprocess
import sys

import pytest
import torch

import fsdp_turbo.ops
import fsdp_turbo.ops.registry
from fsdpturbo import registry
from fsdpturbo._native import lib

FALLBACK = "Operator '{}' not available for device '{}', falling back to CPU implementation"


def fallback_warnings(caplog, op, device):
    return [r for r in caplog.records if r.getMessage() == FALLBACK.format(op, device)]


def test_exact_match_and_cpu_fallback_warned_once(caplog):
    @fsdp_turbo.ops.register_op("t_matmul", "cpu")
    def cpu_impl(x, *, scale=1):
        return ("cpu", x, scale)

    @fsdp_turbo.ops.register_op("t_matmul", "npu")
    def npu_impl(x, *, scale=1):
        return ("npu", x, scale)

    assert cpu_impl.__name__ == "cpu_impl", "the decorator returns the function unchanged"
    assert fsdp_turbo.ops.get_op("t_matmul", "npu") is npu_impl
    assert fsdp_turbo.ops.get_op("t_matmul", "cpu") is cpu_impl
    with caplog.at_level(logging.WARNING, logger="fsdpturbo.registry"):
        assert fsdp_turbo.ops.registry.get_op("t_matmul", "cuda") is cpu_impl
        assert fsdp_turbo.ops.get_op("t_matmul", "cuda") is cpu_impl
        assert fsdp_turbo.ops.dispatch_op("t_matmul", 3, device_type="xpu", scale=2) == ("cpu", 3, 2)
    assert len(fallback_warnings(caplog, "t_matmul", "cuda")) == 1
    assert len(fallback_warnings(caplog, "t_matmul", "xpu")) == 1
    # A torch.device stands for its type.
    assert fsdp_turbo.ops.dispatch_op("t_matmul", 5, device_type=torch.device("cuda", 1)) == ("cpu", 5, 1)


def test_re_registering_replaces_silently():
    @registry.register_op("t_replace", "cpu")
    def first():
        return 1

    @registry.register_op("t_replace", "cpu")
    def second():
        return 2

    assert registry.dispatch_op("t_replace", device_type="cpu") == 2
    assert fsdp_turbo.ops._OPERATOR_REGISTRY["t_replace"] == {"cpu": second}
    assert "t_replace" in fsdp_turbo.ops._OPERATOR_REGISTRY
    assert first not in registry._IMPLS.values(), "the replaced callable is released"


def test_the_seeds_key_errors():
    with pytest.raises(KeyError, match=r"Operator 't_never' is not registered"):
        fsdp_turbo.ops.get_op("t_never", "cpu")
    registry.register_op("t_npu_only", "npu")(lambda: None)
    with pytest.raises(KeyError, match=r"Operator 't_npu_only' not available for device 'cuda' and no CPU "
                                       r"fallback exists; it is registered for \['npu'\]"):
        fsdp_turbo.ops.get_op("t_npu_only", "cuda")
    with pytest.raises(KeyError):
        fsdp_turbo.ops.dispatch_op("t_npu_only", device_type="cpu")


def test_bad_names_devices_and_functions_are_rejected():
    with pytest.raises(ValueError, match=r"device type \"cuda:0\" is not valid.*pass its type, 'cuda'"):
        registry.register_op("t_bad", "cuda:0")(lambda: None)
    with pytest.raises(ValueError, match=r"operator name \"t bad\" is not valid"):
        registry.register_op("t bad", "cpu")(lambda: None)
    with pytest.raises(ValueError, match=r"device type \"CPU\" is not valid"):
        registry.get_op("t_bad", "CPU")
    with pytest.raises(TypeError, match=r"device_type must be a str, got int"):
        registry.register_op("t_bad", 0)
    with pytest.raises(ValueError, match=r"op_name 't_bad\\x00x' contains a NUL character"):
        registry.get_op("t_bad\0x", "cpu")
    with pytest.raises(TypeError, match=r"decorates a callable, got int"):
        registry.register_op("t_bad", "cpu")(3)
    with pytest.raises(KeyError, match="is not registered"):
        registry.get_op("t_bad", "cpu")


def test_an_operator_registered_through_the_c_abi_has_no_python_callable():
    impl, replaced = ctypes.c_uint64(), ctypes.c_uint64()
    assert lib.fsdpturbo_op_register(b"t_from_c", b"cpu", ctypes.byref(impl), ctypes.byref(replaced)) == 0
    with pytest.raises(KeyError, match=r"'t_from_c' for device 'cpu' was registered outside Python"):
        registry.get_op("t_from_c", "cpu")
    assert fsdp_turbo.ops._OPERATOR_REGISTRY["t_from_c"] == {}


def test_default_device_is_the_build_accelerator_and_cuda_is_not_started():
    # A fresh interpreter: get_op without a device on this host (a CUDA build of torch on a CPU
    # host resolves "cuda", as the seed's torch.accelerator lookup does) must not initialise CUDA.
    probe = (
        "import torch, fsdp_turbo.ops.fla\n"
        "from fsdp_turbo.ops.registry import get_op\n"
        "from fsdpturbo.registry import current_device_type\n"
        "acc = torch.accelerator.current_accelerator()\n"
        "assert current_device_type() == (acc.type if acc is not None else 'cpu'), current_device_type()\n"
        "if current_device_type() in ('cuda', 'npu'):\n"
        "    assert get_op('chunk_gated_delta_rule').__module__ == 'fsdp_turbo.ops.fla'\n"
        "print(current_device_type(), torch.cuda.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True,
                         env=dict(os.environ), timeout=120)
    device, initialised = out.stdout.split()
    assert device in ("cpu", "cuda", "npu", "xpu", "mps")
    assert initialised == "False"
