"""A tiny random Qwen3.5 for tests and `--enhance tiny-random` (enhance.py's tiny_enhancer): its rewrites are
gibberish from random weights. Its tokenizer is byte-level (every UTF-8 byte one token, no merges) with Qwen's chat
special tokens, Qwen3.5's think tags and chat template; the tiny Qwen-Image pipeline's (../tiny.py) starts from the
same bytes and special tokens."""

import torch
from transformers import Qwen2Tokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

TINY_ENHANCER_ID = "tiny-random"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# The text-only part of Qwen3.5's chat template: system / user / assistant turns, then the generation prompt, which
# with enable_thinking=False pre-fills an empty think block and otherwise opens one.
QWEN35_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Qwen3.5's <think> and </think> are added tokens that decoding keeps (not special).
THINK_TOKENS = ("<think>", "</think>")
# The real SYSTEM_PROMPT is ~2,300 byte-level tokens here: about a minute of prefill in Triton's interpreter.
TINY_ENHANCER_SYSTEM_PROMPT = "Rewrite."
# Real sizes: Qwen3.5-4B (DEFAULT_ENHANCER_ID) as guessed in benchmarks/bench_text.py (no config could be read here);
# the values not marked "4B guess" are those of transformers' default Qwen3_5TextConfig (Qwen3.5-9B style).
TINY_QWEN35 = dict(
    hidden_size=45,  # 2560 (4B guess)
    intermediate_size=71,  # 9216 (4B guess)
    num_hidden_layers=2,  # 32
    layer_types=["linear_attention", "full_attention"],  # 3 linear : 1 full, x8
    num_attention_heads=4,  # 16
    num_key_value_heads=2,  # 4
    head_dim=24,  # 256
    linear_num_key_heads=2,  # 16
    linear_num_value_heads=4,  # 32
    linear_key_head_dim=12,  # 128
    linear_value_head_dim=20,  # 128
    tie_word_embeddings=False,  # True (4B guess); tied random weights greedily repeat the last input token
    initializer_range=0.2,  # 0.02; smaller random weights give every prompt the same gibberish
)


def byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes 0..255 (GPT-2's table, rebuilt here)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def byte_vocab() -> dict[str, int]:
    """A byte-level tokenizer's vocabulary: the 256 byte symbols, then SPECIAL_TOKENS (no merges)."""
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return vocab


def tiny_qwen35_tokenizer() -> Qwen2Tokenizer:
    """Byte-level like tiny_tokenizer, with Qwen3.5's chat tokens, its think tags and QWEN35_CHAT_TEMPLATE."""
    tokenizer = Qwen2Tokenizer(vocab=byte_vocab(), merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               additional_special_tokens=list(SPECIAL_TOKENS[1:]))
    tokenizer.add_tokens(list(THINK_TOKENS))
    tokenizer.chat_template = QWEN35_CHAT_TEMPLATE
    return tokenizer


def tiny_qwen35(vocab_size: int, seed: int = 0, **overrides):
    """A tiny random transformers Qwen3_5ForCausalLM (fp32, CPU)."""
    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TINY_QWEN35, "vocab_size": vocab_size, **overrides})).eval()
