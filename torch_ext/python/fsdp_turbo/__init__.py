"""Compatibility package: the import paths of the seed's `fsdp_turbo`, backed by `fsdpturbo`,
so an existing trainer runs unchanged: LlamaFactory's plugin (EP, EFSDP, patches, ops) and
FSDPTurbo's standalone API (`fsdp_turbo.fsdp_turbo.FSDPTurbo`, `fsdp_turbo_config`,
`distributed.parallel_state`, `training.clip_grads`) that verl and the ms-swift fork call."""
