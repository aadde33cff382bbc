"""The mc2 dispatcher (seed §5.4): AllToAllV joined with the first grouped matmul and the second
grouped matmul joined with AllToAllV, on Ascend NPUs.

Structure as the seed's `npu_alltoallv_gmm` / `npu_gmm_alltoallv` calls: the send counts are my
rows per global expert (length E), the receive counts the gathered counts of my local experts
(length P·L, source-major); received rows are regrouped local-expert-major for the grouped
matmul and put back in source order before the return all-to-all. Backward mirrors it (the data
gradient is the all-to-all with the counts swapped, the weight gradient a grouped matmul split
along K with the per-local-expert totals, `fsdpturbo::grouped_mm`'s autograd).

What runs: the all-to-all is `HcclAlltoAllV` on an HCCL communicator this module makes for the
EP group from a root info (`HcclGetRootInfo` on the group's first rank, broadcast over the
group, `HcclCommInitRootInfo`), queued on torch_npu's current stream next to the aclnn grouped
matmul. It is not torch_npu's single fused MC2 kernel (`aclnnAlltoAllvGroupedMatMul`), whose C
signature is not in our reference; the results are the same, the overlap inside the kernel is not.
"""
import ctypes

import torch
import torch.distributed as dist

from ._native import check, lib, ops

ROOT_INFO_BYTES = 4108

lib.fsdpturbo_hccl_root_info.restype = ctypes.c_int32
lib.fsdpturbo_hccl_root_info.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
lib.fsdpturbo_hccl_comm_new.restype = ctypes.c_int32
lib.fsdpturbo_hccl_comm_new.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_uint32,
                                        ctypes.POINTER(ctypes.c_void_p)]
lib.fsdpturbo_hccl_comm_free.restype = None
lib.fsdpturbo_hccl_comm_free.argtypes = [ctypes.c_void_p]

_COMMS = {}
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


class HcclCommunicator:
    """An HCCL communicator over the ranks of a process group (every rank must construct it)."""

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

    def __del__(self):
        lib.fsdpturbo_hccl_comm_free(self.handle)


def communicator(group):
    """The cached HCCL communicator of `group` (made collectively on first use)."""
    key = (tuple(dist.get_process_group_ranks(group)), group.group_name)
    if key not in _COMMS:
        _COMMS[key] = HcclCommunicator(group)
    return _COMMS[key].handle


def _a2a_setup(ctx, inputs, output):
    _, ctx.comm, ctx.output_splits, ctx.input_splits = inputs


def _a2a_backward(ctx, grad):
    return ops.hccl_all_to_all_v(grad.contiguous(), ctx.comm, ctx.input_splits, ctx.output_splits), None, None, None


torch.library.register_autograd("fsdpturbo::hccl_all_to_all_v", _a2a_backward, setup_context=_a2a_setup)


@torch.library.register_fake("fsdpturbo::hccl_all_to_all_v")
def _a2a_fake(x, comm, output_splits, input_splits):
    return x.new_empty((sum(output_splits), x.size(1)))


def _expert_major(recv_counts, ep_size, local):
    """Order that takes received rows (source-major, then local expert) to local-expert-major."""
    starts, at = [], 0
    for n in recv_counts:
        starts.append(at)
        at += n
    order = [starts[s * local + e] + i for e in range(local) for s in range(ep_size)
             for i in range(recv_counts[s * local + e])]
    return torch.tensor(order, dtype=torch.int64)


def _check(x, weight, send_counts, recv_counts, ep_size, name):
    if weight.dim() != 3 or x.dim() != 2 or x.size(1) != weight.size(2):
        raise ValueError(f"{name}: x [rows, in] and weight [local experts, out, in] expected, "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: x and weight must share one dtype of bfloat16, float16 or float32 "
                         f"(aclnn grouped matmul), got {x.dtype} and {weight.dtype}")
    local = weight.size(0)
    if len(recv_counts) != ep_size * local:
        raise ValueError(f"{name}: recv_counts has {len(recv_counts)} entries; ep size {ep_size} × "
                         f"{local} local experts = {ep_size * local} are needed")
    if len(send_counts) != ep_size * local:
        raise ValueError(f"{name}: send_counts has {len(send_counts)} entries; one per global expert "
                         f"({ep_size * local}) is needed")
    if min(list(send_counts) + list(recv_counts), default=0) < 0:
        raise ValueError(f"{name}: counts must be non-negative")
    return local


def _per_rank(counts, ep_size, local):
    return [sum(counts[p * local:(p + 1) * local]) for p in range(ep_size)]


def alltoallv_gmm(x, weight, comm, ep_size, send_counts, recv_counts):
    """`npu_alltoallv_gmm`: rows of x (grouped by global expert, `send_counts` per expert) to
    their experts' ranks, then the grouped matmul with my local experts' `weight` [L, out, in].
    Returns the output local-expert-major [received rows, out] and the order used."""
    local = _check(x, weight, send_counts, recv_counts, ep_size, "alltoallv_gmm")
    if x.size(0) != sum(send_counts):
        raise ValueError(f"alltoallv_gmm: send_counts sum to {sum(send_counts)} rows but x has {x.size(0)}")
    received = ops.hccl_all_to_all_v(x.contiguous(), comm, _per_rank(recv_counts, ep_size, local),
                                     _per_rank(send_counts, ep_size, local))
    order = _expert_major(recv_counts, ep_size, local).to(x.device)
    per_expert = torch.tensor([sum(recv_counts[s * local + e] for s in range(ep_size)) for e in range(local)],
                              dtype=torch.int64)
    grouped = ops.moe_permute(received, order, 1)
    return ops.grouped_mm(grouped, per_expert.to(x.device), weight), order


def gmm_alltoallv(y, weight, comm, ep_size, recv_counts, send_counts, order):
    """`npu_gmm_alltoallv`: the grouped matmul of local-expert-major rows `y` with `weight`
    [L, out, in], back to source order and to the ranks the rows came from. Returns
    [sum(send_counts), out] in the sender's order."""
    local = _check(y, weight, send_counts, recv_counts, ep_size, "gmm_alltoallv")
    if y.size(0) != sum(recv_counts):
        raise ValueError(f"gmm_alltoallv: recv_counts sum to {sum(recv_counts)} rows but y has {y.size(0)}")
    per_expert = torch.tensor([sum(recv_counts[s * local + e] for s in range(ep_size)) for e in range(local)],
                              dtype=torch.int64)
    out = ops.grouped_mm(y.contiguous(), per_expert.to(y.device), weight)
    source_order = ops.moe_unpermute(out, order, None, out.size(0), 1)
    return ops.hccl_all_to_all_v(source_order, comm, _per_rank(send_counts, ep_size, local),
                                 _per_rank(recv_counts, ep_size, local))


def mc2_forward(module, hidden_states, top_k_index, top_k_weights, *, ep_group, fixed_router=False):
    """The mc2 dispatcher's forward (seed §5.4) for an expert module prepared by
    `expert_parallelize_modules`."""
    from .ep import _check_ids, _gathered_counts, _local_weight, _prepare

    hidden, index, weights = _prepare(module, hidden_states, top_k_index, top_k_weights, fixed_router)
    tokens, top_k = index.shape
    num_experts, local = module.num_global_experts, module.num_local_experts
    ep_size, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    flat = index.reshape(-1)
    routed = {}

    def count(_flat):
        routed["counts"], routed["permutation"], _ = ops.moe_route(index, num_experts, ep_size)
        return routed["counts"]

    gathered = _gathered_counts([flat], num_experts, ep_group, count)
    _check_ids(flat, top_k, num_experts, gathered, ep_group)
    send_counts = routed["counts"].tolist()
    recv_counts = gathered[:, 0, ep_rank * local:(ep_rank + 1) * local].reshape(-1).tolist()
    comm = communicator(ep_group)
    permuted = ops.moe_permute(hidden.contiguous(), routed["permutation"], top_k)
    gate_up, down = _local_weight(module.gate_up_proj), _local_weight(module.down_proj)
    fc1, order = alltoallv_gmm(permuted, gate_up, comm, ep_size, send_counts, recv_counts)
    gate, up = fc1.chunk(2, dim=-1)
    limit = getattr(module, "limit", None)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    y = gmm_alltoallv(module.act_fn(gate) * up, down, comm, ep_size, recv_counts, send_counts, order)
    result = ops.moe_unpermute(y, routed["permutation"], weights, tokens, top_k)
    return result.view(hidden_states.shape)
