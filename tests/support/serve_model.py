"""A tiny random-weight Llama and a byte-level BPE tokenizer with a chat template, made offline,
for ``kvj serve`` on vLLM's CPU backend (``tests/serve``): float32 (batch-invariant on the CPU),
weights scaled by 4 so that outputs depend on context, the tokenizer trained on the standard
library's sources (nothing is downloaded)."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 1024


def _corpus() -> Iterator[str]:
    root = os.path.dirname(json.__file__).rsplit("/", 1)[0]
    for path in sorted(glob.glob(os.path.join(root, "*.py")))[:200]:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def make_model(out: str, seed: int = 0) -> str:
    """Save the tokenizer and the model in ``out`` (a directory vLLM serves); returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
                      pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=None,
                      torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # random weights at init scale barely depend on context
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    import sys

    print(make_model(sys.argv[1]))
