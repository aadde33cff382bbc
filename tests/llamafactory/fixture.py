"""Builds, offline, what LlamaFactory's trainer needs for the real-consumer test: a tiny
random Qwen3-MoE saved with `save_pretrained` (the per-expert safetensors layout real
checkpoints have), a tiny random Qwen3.5-MoE (LlamaFactory loads it as the image-text model
`Qwen3_5MoeForConditionalGeneration`: a one-block vision tower, a linear- and a full-attention
layer; text-only data), a byte-level BPE tokenizer trained with `tokenizers` and carrying a ChatML
chat template, a small `messages` jsonl in LlamaFactory v1's format and a jsonl of preference
pairs (`chosen_messages`, `rejected_messages`) for DPO and reward modelling.

    python fixture.py OUT_DIR  # writes OUT_DIR/model/, OUT_DIR/model_qwen3_5_moe/, data.jsonl and pairs.jsonl
"""
import json
import os
import random
import sys

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("expert router token shard gradient mesh rank layer weight batch loss step norm "
         "all to all dispatch combine permute sum mean scatter gather reduce").split()


def _message(role, text):
    return {"role": role, "content": [{"type": "text", "value": text}], "loss_weight": float(role == "assistant")}


def _words(rng, low, high):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def conversations(count, seed):
    rng = random.Random(seed)
    return [{"messages": [_message("user", f"{i}: {_words(rng, 4, 12)}?"), _message("assistant", _words(rng, 6, 20))]}
            for i in range(count)]


def pairs(count, seed):
    """Short enough that a chosen and a rejected conversation together fit in 128 tokens (a
    truncated response leaves ORPO's log-odds infinite)."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        prompt = _message("user", f"{i}: {_words(rng, 2, 5)}?")
        rows.append({"chosen_messages": [prompt, _message("assistant", _words(rng, 3, 8))],
                     "rejected_messages": [prompt, _message("assistant", _words(rng, 3, 8))]})
    return rows


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, chat_template=CHATML)


def model(vocab_size):
    """norm_topk_prob=False (Hugging Face's default): with renormalised top-k weights the
    router logits of unselected experts have an exact-zero gradient, whose rounding noise AdamW
    turns into lr-sized steps of random sign, so no two correct implementations would agree
    there to 1e-6."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=False,
                            max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
                            output_router_logits=False, torch_dtype="float32")
    torch.manual_seed(1234)
    return Qwen3MoeForCausalLM(config).float()


def model_qwen3_5_moe(vocab_size):
    """Qwen3.5-MoE's composite model at the text model's sizes of `model`: its router always
    renormalises the top-k weights."""
    import torch
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=256,
                initializer_range=0.1, tie_word_embeddings=False)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=64)
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(1234)
    return Qwen3_5MoeForConditionalGeneration(config).float()


MODELS = {"qwen3_moe": ("model", model), "qwen3_5_moe": ("model_qwen3_5_moe", model_qwen3_5_moe)}


def _tokenizer_is_the_processor(path):
    """Text-only data needs no image processor: AutoProcessor (what LlamaFactory loads) returns
    the tokenizer its config names as the processor class, instead of Qwen3.5's vision-language
    processor, whose image and video processors this fixture does not build."""
    config_file = os.path.join(path, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["processor_class"] = config["tokenizer_class"]
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)


def main(out):
    rows = conversations(64, seed=7)
    os.makedirs(out, exist_ok=True)
    _write_jsonl(os.path.join(out, "data.jsonl"), rows)
    _write_jsonl(os.path.join(out, "pairs.jsonl"), pairs(64, seed=11))
    texts = [m["content"][0]["value"] for row in rows for m in row["messages"]]
    tok = tokenizer(texts)
    for directory, build in MODELS.values():
        path = os.path.join(out, directory)
        build(len(tok)).save_pretrained(path)
        tok.save_pretrained(path)
    _tokenizer_is_the_processor(os.path.join(out, MODELS["qwen3_5_moe"][0]))


if __name__ == "__main__":
    main(sys.argv[1])
