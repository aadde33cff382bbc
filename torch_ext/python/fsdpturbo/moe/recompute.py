"""Whether the forward running now is the one activation checkpointing re-runs in backward."""
import torch


def in_recomputation():
    """True while autograd runs a backward in eager mode: a forward running then is a
    recomputation (activation checkpointing, reentrant or not). A forward torch.compile traces
    never is: the compiled backward recomputes inside its own graph without running Python."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1
