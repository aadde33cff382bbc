"""The mc2 dispatcher (seed §5.4) on Ascend NPUs: the all-to-all-v fused with the first grouped
matmul (`aclnnAlltoAllvGroupedMatMul`, torch_npu's `npu_alltoallv_gmm`) and the second grouped
matmul fused with the all-to-all-v back (`aclnnGroupedMatMulAlltoAllv`, `npu_gmm_alltoallv`),
both over the EP process group's own HCCL communicator, found by its name
(`group._get_backend(npu).get_hccl_comm_name(rank)`), and queued on torch_npu's current stream.

Structure as the seed's: the tokens are permuted by expert (`aclnnMoeTokenPermute`); the send
counts are my rows per global expert (length E), the receive counts the gathered counts of my
local experts (length P·L, source-major); the operators regroup received rows local-expert-major
and put them back in source order themselves; the weighted combine is `aclnnMoeTokenUnpermute`.
Backward mirrors it: the data gradient is the mirrored fused operator with the counts swapped
and the weight untransposed, the weight gradient a grouped matmul split along K
(`fsdpturbo::grouped_mm_grad_weight`) with the per-local-expert totals, using the permuted rows
the first operator returns (permuteOutFlag); both are registered in fsdpturbo.moe.ops.

In the common pipeline (fsdpturbo.moe.dispatch.pipeline) the rows leave inside the first operator
and come back inside the second: mc2's dispatch is the permute alone, its expert compute both
fused operators, its combine the unpermute alone. LoRA adapters on the expert weights
(fsdpturbo.moe.expert_lora) add rank-r fused operators and grouped matmuls (`Mc2Strategy.compute`).

Hardware limits (ops-transformer's mc2/ docs): Atlas A3 only; ep size 8, 16, 32 or 64;
at most 32 local experts and 256 counts; bfloat16 or float16. They are checked before launch.
"""
import ctypes
import functools

import torch
import torch.distributed as dist

from ... import _abi
from ..._native import check, lib, ops
from . import device, experts
from .fused import TokenPermuteStrategy
from .pipeline import run

ROOT_INFO_BYTES = _abi.FSDPTURBO_HCCL_ROOT_INFO_BYTES
COMM_NAME_BYTES = _abi.FSDPTURBO_HCCL_COMM_NAME_BYTES
EP_SIZES_ON_NPU = (8, 16, 32, 64)

_COMM_NAMES = {}  # process group -> its HCCL communicator's name (groups live as long as the program)
_TEST_COMMS = {}


class _TestCommunicator:
    """Test mode: the HCCL double's communicator over a (gloo) group's ranks, made from a root
    info broadcast over the group, standing in for ProcessGroupHCCL's own communicator."""

    def __init__(self, group):
        ranks = dist.get_process_group_ranks(group)
        root = ctypes.create_string_buffer(ROOT_INFO_BYTES)
        if dist.get_rank() == ranks[0]:
            check(lib.fsdpturbo_hccl_root_info(root, ROOT_INFO_BYTES))
        box = [root.raw]
        dist.broadcast_object_list(box, src=ranks[0], group=group)
        handle = ctypes.c_void_p()
        check(lib.fsdpturbo_hccl_comm_new(box[0], ROOT_INFO_BYTES, len(ranks), dist.get_rank(group),
                                          ctypes.byref(handle)))
        self.handle = handle.value
        name = ctypes.create_string_buffer(COMM_NAME_BYTES)
        check(lib.fsdpturbo_hccl_comm_name(self.handle, name, COMM_NAME_BYTES))
        self.name = name.value.decode()

    def __del__(self):
        lib.fsdpturbo_hccl_comm_free(self.handle)


def comm_name(group):
    """The name of `group`'s HCCL communicator, which the MC2 operators take (seed:
    `group._get_backend(torch.device("npu")).get_hccl_comm_name(global_rank)`)."""
    if device.test_double_enabled():
        key = (tuple(dist.get_process_group_ranks(group)), group.group_name)
        if key not in _TEST_COMMS:
            _TEST_COMMS[key] = _TestCommunicator(group)
        return _TEST_COMMS[key].name
    if group not in _COMM_NAMES:
        try:
            backend = group._get_backend(torch.device("npu"))
            _COMM_NAMES[group] = backend.get_hccl_comm_name(dist.get_rank())
        except (AttributeError, RuntimeError) as e:
            raise RuntimeError(f"mc2: the EP process group has no HCCL backend with get_hccl_comm_name ({e}); "
                               f"initialise torch.distributed with backend 'hccl' under torch_npu") from e
    return _COMM_NAMES[group]


def check_ep_size(ep_size):
    """The ep sizes aclnnAlltoAllvGroupedMatMul accepts on Atlas A3 (the test double takes any)."""
    if not device.test_double_enabled() and ep_size not in EP_SIZES_ON_NPU:
        raise ValueError(f"mc2: the MC2 operators run with an ep size of {', '.join(map(str, EP_SIZES_ON_NPU))} "
                         f"(Atlas A3), got {ep_size}; use the 'fused' dispatcher for other sizes")


def alltoallv_gmm(x, weight, group, send_counts, recv_counts):
    """The seed's `all2all_grouped_matmul`: rows of x (grouped by global expert, `send_counts`
    per expert) to their experts' ranks of `group`, times my local experts' `weight`
    [L, out, in]. Returns [sum(recv_counts), out], local-expert-major."""
    y, _ = ops.alltoallv_grouped_mm(x.contiguous(), weight, comm_name(group), dist.get_world_size(group),
                                    list(send_counts), list(recv_counts), True)
    return y


def gmm_alltoallv(y, weight, group, send_counts, recv_counts):
    """The seed's `grouped_matmul_all2all`: local-expert-major rows `y` times `weight`
    [L, out, in], back to the ranks they came from (`send_counts[r·L + j]` rows of my expert j
    return to rank r). Returns [sum(recv_counts), out] in the order the rows were sent."""
    return ops.grouped_mm_alltoallv(y.contiguous(), weight, comm_name(group), dist.get_world_size(group),
                                    list(send_counts), list(recv_counts), True)


class Mc2Strategy(TokenPermuteStrategy):
    """The NPU kernels' routing by expert id with the all-to-alls inside the grouped matmuls."""

    def dispatch(self, hidden, route, ep_group):
        return self.permute(hidden, route)

    def compute(self, module, received, route, ep_group):
        gate_up, down = experts.expert_projections(module)
        sends, blocks = route.receive.sends, route.receive.blocks
        there = functools.partial(alltoallv_gmm, group=ep_group, send_counts=sends, recv_counts=blocks)
        back = functools.partial(gmm_alltoallv, group=ep_group, send_counts=blocks, recv_counts=sends)
        # A LoRA adapter (s·(x·downᵀ)·upᵀ) is two rank-r matmuls on the routed rows: the one beside
        # the all-to-all runs inside the same fused operator (gate_up's down factor with the rows'
        # way there, down_proj's up factor with their way back), the other is the fused
        # dispatcher's grouped matmul on the local-expert-major rows. The operators return the
        # received rows only as a non-differentiable output, so the adapter's rows travel once
        # more, each way, instead of sharing the base weight's exchange (that would need the two
        # weights concatenated: a copy of the expert weights every step). The all-to-all only
        # moves rows, so every element is the fused dispatcher's out + adapter, summed the same.
        per_expert = torch.tensor(route.receive.tokens_per_local_expert, dtype=torch.int64, device=received.device)
        grouped = functools.partial(experts.grouped_linear, counts=per_expert)
        hidden = experts.activation(module, gate_up(received, there, up_matmul=grouped))
        return down(hidden, back, down_matmul=grouped)

    def combine(self, y, route, weights, ep_group):
        return self.unpermute(y, route, weights)


MC2 = Mc2Strategy()


def check_available(ep_group):
    """What rules mc2 out before any forward: a host without an NPU (and no test double), an ep
    size the operators do not take."""
    if not device.npu_available():
        raise RuntimeError("The 'mc2' dispatcher runs only on Ascend NPUs (the MC2 operators "
                           "aclnnAlltoAllvGroupedMatMul / aclnnGroupedMatMulAlltoAllv); this host has no NPU. "
                           "Use 'eager', 'fused' or 'domino'.")
    check_ep_size(dist.get_world_size(ep_group))


def mc2_forward(module, hidden_states, top_k_index, top_k_weights, *, ep_group, fixed_router=False):
    """The mc2 dispatcher's forward (seed §5.4) for an expert module prepared by
    `expert_parallelize_modules`."""
    return run(MC2, module, hidden_states, top_k_index, top_k_weights, ep_group=ep_group, fixed_router=fixed_router)
