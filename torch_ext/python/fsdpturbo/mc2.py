"""The mc2 dispatcher's former module path: its operators and checks live in
fsdpturbo.dispatch.mc2, the test-double switch in fsdpturbo.dispatch.device."""
from .dispatch.device import enable_test_double, runs_npu_kernels  # noqa: F401
from .dispatch.device import npu_available as available  # noqa: F401
from .dispatch.mc2 import (COMM_NAME_BYTES, EP_SIZES_ON_NPU, ROOT_INFO_BYTES, alltoallv_gmm,  # noqa: F401
                           check_ep_size, comm_name, gmm_alltoallv, mc2_forward)
