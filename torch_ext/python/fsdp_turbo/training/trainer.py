"""FSDPTurbo's `BaseTrainer` (a whole trainer: data, optimizer, checkpoints, monitor) is not
built: importing it says so rather than failing later on a missing name."""
raise ImportError("fsdp_turbo.training.trainer.BaseTrainer (FSDPTurbo's own trainer) is not built by fsdpturbo; "
                  "drive FSDPTurbo(config, model) from your trainer (verl's fsdp_turbo engine does): see docs/verl.md")
