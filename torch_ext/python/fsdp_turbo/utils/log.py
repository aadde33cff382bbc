"""The seed's `fsdp_turbo.utils.log.set_log_level` (ms-swift's trainer calls
`set_log_level("INFO")` before it builds the engine)."""
import logging

__all__ = ["set_log_level"]

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOGGERS = ("fsdpturbo", "fsdp_turbo")  # this package's loggers and those of its compatibility paths


def set_log_level(level):
    """Sets the level of this package's loggers to `level` (one of `LEVELS`, any case, or a
    `logging` level number). Raises ValueError naming what is accepted for anything else."""
    if isinstance(level, str) and level.upper() in LEVELS:
        number = getattr(logging, level.upper())
    elif isinstance(level, int) and not isinstance(level, bool) and level >= 0:
        number = level
    else:
        raise ValueError(f"fsdp_turbo.utils.log.set_log_level: level {level!r}; accepted: one of {list(LEVELS)} "
                         f"(any case) or a logging level number >= 0")
    for name in LOGGERS:
        logging.getLogger(name).setLevel(number)
