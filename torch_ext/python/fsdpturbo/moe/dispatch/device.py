"""Where the dispatchers' kernels run: the one place that knows whether this host has an Ascend
NPU and whether the NPU kernels' test double is switched on."""
import torch

from ..._native import ops

_TEST_DOUBLE = False


def enable_test_double():
    """Tests only: runs the NPU kernels on CPU tensors over fsdpturbo's C test doubles of CANN
    (tests/doubles). libfsdpturbo refuses unless every CANN library it loads is the double, so
    this cannot switch a production process onto fake kernels."""
    global _TEST_DOUBLE
    ops._ascend_test_double_enable()
    _TEST_DOUBLE = True


def test_double_enabled():
    """Whether `enable_test_double` has switched this process onto the CANN test doubles."""
    return _TEST_DOUBLE


def npu_available():
    """Whether the NPU kernels (mc2 included) can run here: torch_npu with an NPU, or the test
    double."""
    if _TEST_DOUBLE:
        return True
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def runs_npu_kernels(tensor):
    """Whether the op library serves `tensor` with its NPU kernels: an NPU tensor, or any tensor
    once the test double is on."""
    return _TEST_DOUBLE or tensor.device.type == "npu"
