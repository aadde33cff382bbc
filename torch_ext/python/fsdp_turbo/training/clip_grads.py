"""`fsdp_turbo.training.clip_grads.clip_grad_norm`, the grad-norm clip verl's `fsdp_turbo`
engine and FSDPTurbo's trainer call."""
from fsdpturbo import norm

__all__ = ["clip_grad_norm"]


def clip_grad_norm(model, max_norm, norm_type=2.0, group=None):
    """Clips the gradients of `model` (the Hugging Face module or its `FSDPTurbo` wrapper) in
    place by their total `norm_type` norm over every mesh they live on (dense HSDP, experts'
    (edp, efsdp, ep): each element counted once) and returns that norm before clipping as a
    float (inf or nan are returned, not raised; gradients are then left alone). The meshes come
    from the gradients themselves: `group` (the original's) must be None. Collective: every
    rank calls it."""
    if group is not None:
        raise ValueError(f"clip_grad_norm: group={group!r}, but the groups come from the gradients' meshes; "
                         f"accepted: None")
    return float(norm.clip_grad_norm_(model, max_norm, norm_type=float(norm_type)))
