"""Builds, offline, what LlamaFactory's trainer needs for the real-consumer test: a tiny
random Qwen3-MoE saved with `save_pretrained` (the per-expert safetensors layout real
checkpoints have), a byte-level BPE tokenizer trained with `tokenizers` and carrying a ChatML
chat template, a small `messages` jsonl in LlamaFactory v1's format and a jsonl of preference
pairs (`chosen_messages`, `rejected_messages`) for DPO and reward modelling.

    python fixture.py OUT_DIR        # writes OUT_DIR/model/, OUT_DIR/data.jsonl and OUT_DIR/pairs.jsonl
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


def main(out):
    rows = conversations(64, seed=7)
    os.makedirs(out, exist_ok=True)
    _write_jsonl(os.path.join(out, "data.jsonl"), rows)
    _write_jsonl(os.path.join(out, "pairs.jsonl"), pairs(64, seed=11))
    texts = [m["content"][0]["value"] for row in rows for m in row["messages"]]
    tok = tokenizer(texts)
    directory = os.path.join(out, "model")
    net = model(len(tok))
    net.save_pretrained(directory)
    tok.save_pretrained(directory)


if __name__ == "__main__":
    main(sys.argv[1])
