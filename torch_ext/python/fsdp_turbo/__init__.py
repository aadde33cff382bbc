"""Compatibility package: the import paths of the seed's `fsdp_turbo`, backed by `fsdpturbo`,
so an existing trainer runs unchanged."""
