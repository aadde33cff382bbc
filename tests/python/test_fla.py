"""The flash-linear-attention kernel plugin (`fsdp_turbo.ops.fla`) and `kernel_config`
application, as the seed and LlamaFactory define them (docs/kernels.md).

`fla` itself needs a GPU, so a stand-in `fla.ops.gated_delta_rule` is put in `sys.modules`
whose kernels are HF transformers' own torch implementations of the gated delta rule
(`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`): the oracle for argument
pass-through and for the `chunk_size` binding (the chunked algorithm's result does not depend
on the chunk size). The layer stand-in has HF's transformers<=5.8 layout (the kernels as
instance attributes, what the seed's plugin patches)."""
import functools
import inspect
import logging
import sys
import types

import pytest
import torch
from torch import nn
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

import fsdp_turbo.ops.fla
from fsdp_turbo.ops import get_op
from fsdp_turbo.ops.registry import get_op as registry_get_op
from fsdpturbo.kernels import apply_flash_linear_attention, apply_kernels

pytestmark = pytest.mark.transformers_5_8  # also run against LlamaFactory's transformers

KERNELS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")


class GatedDeltaNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.chunk_gated_delta_rule = hf.torch_chunk_gated_delta_rule
        self.recurrent_gated_delta_rule = hf.torch_recurrent_gated_delta_rule

    def forward(self, q, k, v, g, beta, recurrent=False):
        kernel = self.recurrent_gated_delta_rule if recurrent else self.chunk_gated_delta_rule
        return kernel(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_attn = GatedDeltaNet()
        self.mlp = nn.Linear(2, 2)


def inputs(seq=40, heads=2, dim=8):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, heads, dim, generator=gen) for _ in range(3))
    g = -nn.functional.softplus(torch.randn(1, seq, heads, generator=gen))
    beta = torch.sigmoid(torch.randn(1, seq, heads, generator=gen))
    return q, k, v, g, beta


def install_fla(monkeypatch, takes_chunk_size):
    """Puts a stand-in `fla` package in sys.modules; returns the list its kernels record calls in."""
    calls = []

    def chunk_without_chunk_size(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                 use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        return hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                               output_final_state=output_final_state,
                                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    def recording(name, fn):
        def kernel(*args, **kwargs):
            calls.append((name, args, kwargs))
            return fn(*args, **kwargs)
        kernel.__signature__ = inspect.signature(fn)
        return kernel

    chunk = hf.torch_chunk_gated_delta_rule if takes_chunk_size else chunk_without_chunk_size
    module = types.ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = recording("chunk", chunk)
    module.fused_recurrent_gated_delta_rule = recording("recurrent", hf.torch_recurrent_gated_delta_rule)
    for name, mod in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                      ("fla.ops.gated_delta_rule", module)):
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


@pytest.fixture
def no_fla(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla` raises ModuleNotFoundError


def test_the_kernels_are_registered_for_cuda_and_npu_under_their_public_module():
    for name in KERNELS:
        for device in ("cuda", "npu"):
            op = registry_get_op(name, device)
            assert op is getattr(fsdp_turbo.ops.fla, name)
            assert op.__module__ == "fsdp_turbo.ops.fla" and op.__name__ == name
        with pytest.raises(KeyError, match=rf"Operator '{name}' not available for device 'cpu' and no CPU fallback"):
            get_op(name, "cpu")


def test_without_fla_a_call_and_the_plugin_name_the_missing_package(no_fla):
    with pytest.raises(ImportError, match=r"fsdp_turbo\.ops\.fla\.chunk_gated_delta_rule needs the "
                                          r"flash-linear-attention package \(import name `fla`"):
        get_op("chunk_gated_delta_rule", "cuda")(*inputs())
    with pytest.raises(ImportError, match=r"fused_recurrent_gated_delta_rule needs the flash-linear-attention"):
        fsdp_turbo.ops.fla.fused_recurrent_gated_delta_rule(*inputs())
    with pytest.raises(RuntimeError, match=r"^Flash Linear Attention and FSDPTurbo are required for this kernel\. "
                                           r".*flash-linear-attention"):
        apply_flash_linear_attention(TinyModel(), device_type="cuda")


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_arguments_pass_through_and_chunk_size_is_bound(monkeypatch, chunk_size):
    calls = install_fla(monkeypatch, takes_chunk_size=True)
    q, k, v, g, beta = inputs()
    op = functools.partial(get_op("chunk_gated_delta_rule", "cuda"), chunk_size=chunk_size)
    out, state = op(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
    assert len(calls) == 1
    name, args, kwargs = calls[0]
    assert name == "chunk" and all(a is b for a, b in zip(args, (q, k, v)))
    assert kwargs == {"g": g, "beta": beta, "initial_state": None, "output_final_state": True,
                      "use_qk_l2norm_in_kernel": True, "chunk_size": chunk_size}
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)
    rec_out, rec_state = get_op("fused_recurrent_gated_delta_rule", "npu")(
        q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert calls[1][0] == "recurrent" and "chunk_size" not in calls[1][2]
    torch.testing.assert_close(rec_out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rec_state, ref_state, rtol=1e-4, atol=1e-5)


def test_an_fla_without_chunk_size_runs_chunks_of_64_only(monkeypatch):
    calls = install_fla(monkeypatch, takes_chunk_size=False)
    op = fsdp_turbo.ops.fla.chunk_gated_delta_rule
    q, k, v, g, beta = inputs()
    op(q, k, v, g, beta, chunk_size=64)
    assert "chunk_size" not in calls[0][2]
    with pytest.raises(ValueError, match=r"chunk_size=32 is not supported by the installed flash-linear-attention"):
        op(q, k, v, g, beta, chunk_size=32)
    for bad in (48, True, "32", None):
        with pytest.raises(ValueError, match=r"chunk_size must be one of \(16, 32, 64\), got "):
            op(q, k, v, g, beta, chunk_size=bad)
    assert len(calls) == 1


def test_flash_linear_attention_kernels_compose_with_auto(monkeypatch, caplog):
    """LlamaFactory's test of the same name, on this package; 'auto' applies
    nothing here (the seed's auto kernels are LlamaFactory's NPU kernels)."""
    install_fla(monkeypatch, takes_chunk_size=True)
    model = TinyModel()
    q, k, v, g, beta = inputs()
    reference = [model.linear_attn(q, k, v, g, beta, recurrent=r) for r in (False, True)]
    config = {"name": "auto, flash-linear-attention",
              "include_kernels": "fused_recurrent_gated_delta_rule, chunk_gated_delta_rule", "chunk_size": 32}
    with caplog.at_level(logging.INFO, logger="fsdpturbo.kernels"):
        assert apply_kernels(model, config, device_type="cuda") is model
    assert get_op("chunk_gated_delta_rule", "cuda").__module__ == "fsdp_turbo.ops.fla"
    chunk = model.linear_attn.chunk_gated_delta_rule
    assert isinstance(chunk, functools.partial)
    assert chunk.func.__module__ == "fsdp_turbo.ops.fla" and chunk.keywords == {"chunk_size": 32}
    assert model.linear_attn.recurrent_gated_delta_rule.__module__ == "fsdp_turbo.ops.fla"
    messages = [r.getMessage() for r in caplog.records]
    assert "kernel_config name 'auto': libfsdpturbo has no automatic kernels for device 'cuda'; nothing applied." \
        in messages
    assert ("Flash Linear Attention kernels updated 2 module callables: "
            "['fused_recurrent_gated_delta_rule', 'chunk_gated_delta_rule'].") in messages
    for recurrent, (ref_out, ref_state) in zip((False, True), reference):
        out, state = model.linear_attn(q, k, v, g, beta, recurrent=recurrent)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="did not match any model module attributes"):
        apply_flash_linear_attention(nn.Linear(2, 2), "chunk_gated_delta_rule", 32, device_type="cuda")


def test_flash_linear_attention_kernel_validates_config(monkeypatch):
    """LlamaFactory's test of the same name, plus the plugin's other checks."""
    install_fla(monkeypatch, takes_chunk_size=True)
    model = TinyModel()
    with pytest.raises(ValueError, match="chunk_size"):
        apply_kernels(model, {"name": "flash-linear-attention", "chunk_size": 48}, device_type="cuda")
    with pytest.raises(ValueError, match="Unsupported Flash Linear Attention kernels"):
        apply_kernels(model, {"name": "flash-linear-attention", "include_kernels": "not_a_kernel"},
                      device_type="cuda")
    with pytest.raises(ValueError, match=r"Plugin 'liger' is not registered under KernelPlugin"):
        apply_kernels(model, {"name": "auto, liger"}, device_type="cuda")
    with pytest.raises(RuntimeError, match=r"^FlashLinearAttentionKernel requires CUDA or NPU, current "
                                           r"accelerator is cpu\.$"):
        apply_flash_linear_attention(model, device_type="cpu")
    with pytest.raises(ValueError, match=r"^HFModel instance is required for FlashLinearAttentionKernel\.$"):
        apply_flash_linear_attention(None, device_type="npu")
    assert model.linear_attn.chunk_gated_delta_rule is hf.torch_chunk_gated_delta_rule, "nothing was patched"
    # include_kernels "auto" (or True) selects both, in the seed's order.
    assert apply_flash_linear_attention(model, True, 16, device_type="npu") == 2
    assert model.linear_attn.chunk_gated_delta_rule.keywords == {"chunk_size": 16}
