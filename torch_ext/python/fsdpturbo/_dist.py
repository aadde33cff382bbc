"""This process's place in the default process group, for code that also runs without one."""
import torch.distributed as dist


def rank():
    """The rank in the default process group; 0 when there is none."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size():
    """The size of the default process group; 1 when there is none."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier():
    """A barrier of the default process group; nothing when there is none."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
