"""The decoder layers of a Hugging Face model: what the outer FSDP2 wraps one by one and what
activation checkpointing re-runs."""
from torch import nn


def decoder_layers(model):
    """The modules the outer FSDP2 wraps one by one: instances of the model's
    `_no_split_modules` classes (Hugging Face's decoder layers), else the children of a
    ModuleList named `layers` or `blocks`."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if layers:
        return layers
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rpartition(".")[2] in ("layers", "blocks"):
            return list(module)
    return []
