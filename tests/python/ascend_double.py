"""fsdpturbo's C test doubles of CANN (tests/doubles, built by CMake into build/ascend_double, or
FSDPTURBO_ASCEND_DOUBLE_DIR as ctest sets it) for the tests that run the NPU code paths (the
fused dispatcher's NPU kernels, mc2) on CPU tensors."""
import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
DOUBLE_DIR = pathlib.Path(os.environ.get("FSDPTURBO_ASCEND_DOUBLE_DIR", REPO / "build" / "ascend_double"))
BUILT = (DOUBLE_DIR / "libopapi.so").is_file()
NOT_BUILT = f"the Ascend test doubles are not built (no {DOUBLE_DIR}/libopapi.so): build with CMake"


def use_double(log):
    """Switches this process onto the doubles, their call log written to `log`."""
    os.environ.update(FSDPTURBO_ACL_PATH=str(DOUBLE_DIR / "libascendcl.so"),
                      FSDPTURBO_HCCL_PATH=str(DOUBLE_DIR / "libhccl.so"),
                      FSDPTURBO_OPAPI_PATH=str(DOUBLE_DIR / "libopapi.so"),
                      FSDPTURBO_NNOPBASE_PATH=str(DOUBLE_DIR / "libnnopbase.so"),
                      FSDPTURBO_DOUBLE_LOG=str(log))
    from fsdpturbo.moe.dispatch import device

    device.enable_test_double()
