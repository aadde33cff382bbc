"""Loaded by every process of the LlamaFactory tests (tests/llamafactory/site is on PYTHONPATH
only in the ctest entries `llamafactory_*` and `verl_ulysses`). Each block works around one limitation of
running LlamaFactory's trainer on CPU gloo ranks with the CUDA build of torch, without editing
LlamaFactory, transformers or torch."""
import importlib.util

import torch
import torch.distributed as dist

# LlamaFactory synchronises `torch.accelerator` after every step, which on a CPU-only host with
# the CUDA build of torch tries to start CUDA. With no accelerator there is nothing to wait for.
if not torch.accelerator.is_available():
    torch.accelerator.synchronize = lambda device=None: None


def _accept_the_cpu_flash_attn_stand_in():
    """LlamaFactory's context parallelism needs `flash_attention_2`; transformers 5.8 takes
    FlashAttention 2 only with CUDA (`is_flash_attn_2_available`) on a device its compatibility
    table lists (no CPU). This accepts the stand-in beside this file (./flash_attn) on CPU. It
    runs before transformers binds the check into `modeling_flash_attention_utils`."""
    if importlib.util.find_spec("transformers") is None:
        return
    import transformers.utils
    from transformers.utils import import_utils

    def is_flash_attn_2_available():
        return importlib.util.find_spec("flash_attn") is not None

    import_utils.is_flash_attn_2_available = transformers.utils.is_flash_attn_2_available = is_flash_attn_2_available
    from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX

    fa2 = FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]
    fa2["supported_devices"] = fa2["supported_devices"] + ((lambda: True, "cpu"),)


_accept_the_cpu_flash_attn_stand_in()


def _alltoall_forward_with_group_sources(ctx, group, out_tensor_list, *tensors):
    """torch 2.15's `torch.distributed.nn` `_AlltoAll.forward` (the backward of
    `torch.distributed.nn.all_gather`, which LlamaFactory's context-parallel loss uses) on gloo
    scatters from `src=i`, a rank of `group` taken as a global rank: on a group without global
    rank 0 it fails ("Global rank 0 is not part of group"). The same scatters with `group_src`."""
    ctx.group = group
    ctx.input_tensor_size_list = [t.size() for t in tensors]
    rank = dist.get_rank(group=group)
    tensors = [t.contiguous() for t in tensors]
    for i in range(dist.get_world_size(group=group)):
        dist.scatter(out_tensor_list[i], tensors if i == rank else None, group=group, group_src=i)
    return tuple(out_tensor_list)


if dist.is_available():
    from torch.distributed.nn import functional as _dist_nn

    _torch_forward = _dist_nn._AlltoAll.forward

    def _alltoall_forward(ctx, group, out_tensor_list, *tensors):
        if dist.get_backend(group=group) is dist.Backend.GLOO:
            return _alltoall_forward_with_group_sources(ctx, group, out_tensor_list, *tensors)
        return _torch_forward(ctx, group, out_tensor_list, *tensors)

    _dist_nn._AlltoAll.forward = staticmethod(_alltoall_forward)
