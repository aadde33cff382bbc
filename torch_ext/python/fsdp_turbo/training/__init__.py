"""fsdp_turbo.training: `clip_grads` (FSDPTurbo's own `BaseTrainer`, `training.trainer`, is not built)."""
