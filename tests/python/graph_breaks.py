"""The graph breaks `torch._dynamo.explain` lists, as (file, function) of the innermost user
frame of each, and the ones the compile tests allow."""

FSDP_HOOKS = ("_fsdp_common.py", "wrapper")  # FSDP2's hooks run under torch._dynamo.disable
HOST_READ = ("pipeline.py", "run")  # the dropless dispatch's gathered counts reach the host


def graph_breaks(explained):
    """{(file, function)} of the innermost user frame of each graph break in `explained`."""
    return {(b.user_stack[-1].filename.rsplit("/", 1)[-1], b.user_stack[-1].name) for b in explained.break_reasons}
