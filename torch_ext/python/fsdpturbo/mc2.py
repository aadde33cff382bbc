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
the first operator returns (permuteOutFlag).

Hardware limits (ops-transformer docs, reference §6.6): Atlas A3 only; ep size 8, 16, 32 or 64;
at most 32 local experts and 256 counts; bfloat16 or float16. They are checked before launch.
"""
import ctypes

import torch
import torch.distributed as dist

from . import _abi
from ._native import check, lib, ops

ROOT_INFO_BYTES = _abi.FSDPTURBO_HCCL_ROOT_INFO_BYTES
COMM_NAME_BYTES = _abi.FSDPTURBO_HCCL_COMM_NAME_BYTES
EP_SIZES_ON_NPU = (8, 16, 32, 64)

_COMM_NAMES = {}  # process group -> its HCCL communicator's name (groups live as long as the program)
_TEST_COMMS = {}
_TEST_DOUBLE = False


def enable_test_double():
    """Tests only: runs the NPU kernels on CPU tensors over fsdpturbo's C test doubles of CANN
    (csrc/testing). libfsdpturbo refuses unless every CANN library it loads is the double, so
    this cannot switch a production process onto fake kernels."""
    global _TEST_DOUBLE
    ops._ascend_test_double_enable()
    _TEST_DOUBLE = True


def available():
    """Whether the mc2 kernels can run here: torch_npu with an NPU, or the test double."""
    if _TEST_DOUBLE:
        return True
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def runs_npu_kernels(tensor):
    """Whether the op library serves `tensor` with its NPU kernels: an NPU tensor, or any tensor
    once the test double is on."""
    return _TEST_DOUBLE or tensor.device.type == "npu"


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
    if _TEST_DOUBLE:
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
    if not _TEST_DOUBLE and ep_size not in EP_SIZES_ON_NPU:
        raise ValueError(f"mc2: the MC2 operators run with an ep size of {', '.join(map(str, EP_SIZES_ON_NPU))} "
                         f"(Atlas A3), got {ep_size}; use the 'fused' dispatcher for other sizes")


def _per_local_expert(counts, local, device):
    """Rows per local expert: the P chunks of L counts summed (the seed's column sums)."""
    totals = [sum(counts[j::local]) for j in range(local)]
    return torch.tensor(totals, dtype=torch.int64, device=device)


def _alltoallv_gmm_setup(ctx, inputs, output):
    x, weight, ctx.group, ctx.ep_size, ctx.send, ctx.recv, ctx.trans = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(weight, output[1])


def _alltoallv_gmm_backward(ctx, grad_y, _grad_permuted):
    weight, permuted = ctx.saved_tensors
    grad_y = grad_y.contiguous()
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = ops.grouped_mm_alltoallv(grad_y, weight, ctx.group, ctx.ep_size, ctx.recv, ctx.send, not ctx.trans)
    if ctx.needs_input_grad[1]:
        per_expert = _per_local_expert(ctx.recv, weight.size(0), grad_y.device)
        grad_w = ops.grouped_mm_grad_weight(grad_y, permuted, per_expert)
        grad_w = grad_w if ctx.trans else grad_w.transpose(1, 2).contiguous()
    return grad_x, grad_w, None, None, None, None, None


def _gmm_alltoallv_setup(ctx, inputs, output):
    x, weight, ctx.group, ctx.ep_size, ctx.send, ctx.recv, ctx.trans = inputs
    ctx.save_for_backward(x, weight)


def _gmm_alltoallv_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_rows = ops.alltoallv_grouped_mm(grad.contiguous(), weight, ctx.group, ctx.ep_size, ctx.recv, ctx.send,
                                                 not ctx.trans)
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = ops.grouped_mm_grad_weight(grad_rows, x, _per_local_expert(ctx.send, weight.size(0), x.device))
        grad_w = grad_w if ctx.trans else grad_w.transpose(1, 2).contiguous()
    return grad_x, grad_w, None, None, None, None, None


torch.library.register_autograd("fsdpturbo::alltoallv_grouped_mm", _alltoallv_gmm_backward,
                                setup_context=_alltoallv_gmm_setup)
torch.library.register_autograd("fsdpturbo::grouped_mm_alltoallv", _gmm_alltoallv_backward,
                                setup_context=_gmm_alltoallv_setup)


def _out_features(weight, trans_weight):
    return weight.size(1) if trans_weight else weight.size(2)


@torch.library.register_fake("fsdpturbo::alltoallv_grouped_mm")
def _alltoallv_gmm_fake(x, weight, group, ep_world_size, send_counts, recv_counts, trans_weight):
    rows = sum(recv_counts)
    return x.new_empty((rows, _out_features(weight, trans_weight))), x.new_empty((rows, x.size(1)))


@torch.library.register_fake("fsdpturbo::grouped_mm_alltoallv")
def _gmm_alltoallv_fake(x, weight, group, ep_world_size, send_counts, recv_counts, trans_weight):
    return x.new_empty((sum(recv_counts), _out_features(weight, trans_weight)))


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


def mc2_forward(module, hidden_states, top_k_index, top_k_weights, *, ep_group, fixed_router=False):
    """The mc2 dispatcher's forward (seed §5.4) for an expert module prepared by
    `expert_parallelize_modules`."""
    from .ep import _host_counts, _prepare, _shaped_like, expert_weight

    hidden, index, weights = _prepare(module, hidden_states, top_k_index, top_k_weights, fixed_router)
    send_counts, recv_counts = _host_counts(index, module, ep_group)
    permuted, slot_rows = ops.moe_token_permute(hidden.contiguous(), index)
    gate_up, down = expert_weight(module, "gate_up_proj"), expert_weight(module, "down_proj")
    gate, up = alltoallv_gmm(permuted, gate_up, ep_group, send_counts, recv_counts).chunk(2, dim=-1)
    limit = getattr(module, "limit", None)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    y = gmm_alltoallv(module.act_fn(gate) * up, down, ep_group, recv_counts, send_counts)
    return _shaped_like(ops.moe_token_unpermute(y, slot_rows, weights), hidden_states)
