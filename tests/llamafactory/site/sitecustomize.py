"""Loaded by the LlamaFactory test's ranks (on PYTHONPATH): LlamaFactory synchronises
`torch.accelerator` after every step, which on a CPU-only host with the CUDA build of torch
tries to start CUDA (a LlamaFactory limitation). With no accelerator there is nothing to wait
for, so the call does nothing."""
import torch

if not torch.accelerator.is_available():
    torch.accelerator.synchronize = lambda device=None: None
