"""Regenerates the Hugging Face module trees the Rust spec tests compare against.

Builds tiny Qwen3-MoE and Qwen3.5-MoE models on the meta device with transformers (the
version pinned in requirements-dev.txt) and records named_modules() and named_parameters().
Run from the repository root: .venv/bin/python tests/data/hf_trees/generate.py
"""
import json
import pathlib

import torch
from transformers import (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

HERE = pathlib.Path(__file__).parent

QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96,
                 moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                 mlp_only_layers=[1], tie_word_embeddings=False)
QWEN3_5_TEXT = dict(model_type="qwen3_5_moe_text", vocab_size=128, hidden_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                    shared_expert_intermediate_size=20, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])


def record(name, config_values, model):
    modules = [n for n, _ in model.named_modules() if not n.startswith("model.visual")]
    params = [[n, list(p.shape)] for n, p in model.named_parameters() if not n.startswith("model.visual")]
    out = {"config": config_values, "modules": modules, "params": params}
    (HERE / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")


def main():
    with torch.device("meta"):
        values = {k: v for k, v in QWEN3_MOE.items() if k != "model_type"}
        record("qwen3_moe", QWEN3_MOE, Qwen3MoeForCausalLM(Qwen3MoeConfig(**values)))
        text = {k: v for k, v in QWEN3_5_TEXT.items() if k != "model_type"}
        vl = Qwen3_5MoeConfig(text_config=text, tie_word_embeddings=False)
        record("qwen3_5_moe", {"model_type": "qwen3_5_moe", "tie_word_embeddings": False,
                               "text_config": QWEN3_5_TEXT},
               Qwen3_5MoeForConditionalGeneration(vl))


if __name__ == "__main__":
    main()
