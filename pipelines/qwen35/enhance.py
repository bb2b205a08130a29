"""PromptEnhancer: a local Qwen3.5 rewrites a short user prompt into the detailed prompt Qwen-Image renders best.

    enhancer = PromptEnhancer.from_pretrained()            # DEFAULT_ENHANCER_ID, on CUDA when available
    enhancer.enhance(["a fox in snow", "一只猫"])             # -> two detailed one-paragraph prompts

Each prompt becomes a chat (SYSTEM_PROMPT, then the prompt as the user turn) rendered by the checkpoint's own chat
template with the generation prompt and thinking off (`enable_thinking=False`: Qwen3.5's template then opens the
answer with an empty <think></think> block; a template without that variable ignores it). All prompts of one call
decode in one batch through generate(), up to the first <|im_end|> / end-of-text token. clean_output() turns the
reply into one paragraph (a stray think block, list markers, a "Prompt:" label and wrapping quotes removed); an empty
reply falls back to the original prompt, with a warning.

Sampling: Qwen's recommended non-thinking settings (temperature 0.7, top_p 0.8, top_k 20) with a fixed seed, so the
same prompts give the same rewrite. Sampled rows draw from one [B, V] noise tensor, so a prompt's sampled rewrite can
depend on the batch it is in; greedy decoding (temperature=0) does not.
"""

import logging
import os
import re
import unicodedata

import torch

from .generate import generate
from .model import FastQwen35ForCausalLM
from .tiny import TINY_ENHANCER_ID, TINY_ENHANCER_SYSTEM_PROMPT, tiny_qwen35, tiny_qwen35_tokenizer

logger = logging.getLogger(__name__)

# Not checked against the hub from here (no network): the 4B member of the Qwen3.5 family. Any Qwen3.5 checkpoint
# (text-only or vision-language; only its text weights load) with a chat template works.
DEFAULT_ENHANCER_ID = "Qwen/Qwen3.5-4B"
DEFAULT_MAX_NEW_TOKENS = 384  # ~200 English words are ~270 tokens; past this a reply is cut at its last sentence

SYSTEM_PROMPT = """\
You are a prompt writer for Qwen-Image, a text-to-image model that follows long, concrete descriptions and renders \
text inside images accurately. Rewrite the user's short image request into one detailed prompt for it.

Rules:
1. Keep the user's intent and every detail they give (subjects, counts, colors, style, mood, words to show). Never \
drop, change or contradict any of them. A request that is already long and detailed needs only small additions.
2. Fill in what a picture needs and the request leaves open: the subject's appearance, pose and action; the setting \
and background; lighting and time of day; the color palette; the style or medium (photograph, oil painting, \
watercolor, 3D render, anime illustration, flat vector poster, ...), and for a photograph the camera, lens and \
framing; the composition (what sits where in the frame, foreground and background). Make one coherent choice for \
each; never list alternatives.
3. Text in the image: put every piece of text the user wants shown in double quotes, exactly as given (same \
spelling, capitalization and language; never translate it), and say where it appears, on what surface, and in what \
lettering (style, color, size). Do not invent text the user did not ask for.
4. Describe only what is visible, in positive terms: no negations, no story beyond the picture, no sounds or smells.
5. Write a single paragraph of at most about 200 words (or 300 Chinese characters): no line breaks, lists or \
headings.
6. Write in the language of the user's request (a Chinese request gets a Chinese prompt); quoted text keeps its own \
language.
7. Output only the prompt itself: no preamble, no explanation, no quotes around it.

Example request: a coffee shop sign that says "Morning Brew"
Example prompt: A hand-painted wooden sign hangs above the door of a small corner coffee shop, reading "Morning \
Brew" in cream-colored serif letters with a thin gold outline, centered on a deep forest-green board. Below the \
lettering, a simple white steaming-cup icon. The shop front has large windows with warm interior light, potted \
herbs on the sill and a chalkboard menu leaning by the entrance. Soft early-morning sunlight comes from the left, \
casting long gentle shadows on the brick wall. Street photography, 35mm lens at eye level, shallow depth of field, \
the sign sharp in the upper third of the frame, natural warm tones."""

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
LIST_MARKER = re.compile(r"^\s*(?:#+|[-*•]|\d+[.)])\s+")
LABEL = re.compile(r"^(?:(?:enhanced|rewritten|improved|final|detailed)\s+)?prompt\s*[:：]\s*|^提示词\s*[:：]\s*",
                   re.IGNORECASE)
SENTENCE_END = re.compile(r"[.!?][\"'”」』)]*(?=\s|$)|[。！？][\"'”」』)]*")  # "3.5" is no sentence end
QUOTES = {'"': '"', "“": "”", "「": "」"}


def is_cjk(char: str) -> bool:
    """CJK ideographs, kana, Hangul and full-width punctuation: lines of these join without a space."""
    return "\u2e80" <= char <= "\u9fff" or "\uac00" <= char <= "\ud7af" or "\uff00" <= char <= "\uffef"


def clean_output(text: str, *, truncated: bool = False, special_tokens=()) -> str:
    """A model reply -> one paragraph of prompt ("" if nothing is left).

    Drops special-token strings (`special_tokens`, never the think tags), everything up to the last </think>, an
    unclosed <think> with what follows it, control characters and "**"; per line, list and heading markers; then a
    leading "Prompt:" label and quotes wrapping the whole reply (only when that quote is not used inside). Lines join
    with a space, or with none between two CJK characters; runs of spaces collapse. truncated: the reply hit
    max_new_tokens, so it is cut after its last full sentence (kept whole if it has none)."""
    for token in special_tokens:
        if token not in (THINK_OPEN, THINK_CLOSE):
            text = text.replace(token, "")
    text = text.rpartition(THINK_CLOSE)[2] if THINK_CLOSE in text else text
    text = text.partition(THINK_OPEN)[0].replace("**", "")
    text = "".join(c for c in text if c.isspace() or unicodedata.category(c) != "Cc")
    paragraph = ""
    for line in text.splitlines():
        line = re.sub(r"\s+", " ", LIST_MARKER.sub("", line)).strip()
        if line:
            joint = "" if not paragraph or (is_cjk(paragraph[-1]) and is_cjk(line[0])) else " "
            paragraph += joint + line
    paragraph = LABEL.sub("", paragraph)
    close, inside = QUOTES.get(paragraph[:1]), paragraph[1:-1]
    if close and len(paragraph) > 1 and paragraph[-1] == close and paragraph[0] not in inside and close not in inside:
        paragraph = inside.strip()
    if truncated:
        ends = [m.end() for m in SENTENCE_END.finditer(paragraph)]
        paragraph = paragraph[:ends[-1]] if ends else paragraph
    return paragraph.strip()


class PromptEnhancer:
    """model: a FastQwen35ForCausalLM; tokenizer: a transformers tokenizer with the checkpoint's chat template.
    name: what produced the rewrites (the checkpoint's id or path), recorded with the images. seed: the default
    sampling seed of enhance() (fixed, so a rewrite can be reproduced). Every option is a plain attribute."""

    def __init__(self, model: FastQwen35ForCausalLM, tokenizer, system_prompt: str = SYSTEM_PROMPT,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.7, top_p: float = 0.8,
                 top_k: int = 20, seed: int = 0, name: str | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; load it from a Qwen3.5 chat checkpoint")
        self.model = model
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.max_new_tokens = max_new_tokens
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.seed = seed
        self.name = name
        vocab = tokenizer.get_vocab()
        stops = {tokenizer.eos_token_id} | {vocab[t] for t in STOP_TOKENS if t in vocab}
        self.stop_token_ids = sorted(i for i in stops if i is not None)

    @classmethod
    def from_pretrained(cls, path_or_id: str = DEFAULT_ENHANCER_ID, device=None, dtype=torch.bfloat16,
                        **kwargs) -> "PromptEnhancer":
        """The tokenizer and chat template (AutoTokenizer) and the model (FastQwen35ForCausalLM) of a Qwen3.5
        checkpoint, a local folder or a hub id. device None: CUDA when available. kwargs go to both transformers
        loaders (revision, local_files_only, ...); change the enhancer's options on the returned object."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path_or_id, **kwargs)
        model = FastQwen35ForCausalLM.from_pretrained(path_or_id, device=device, dtype=dtype, **kwargs)
        return cls(model, tokenizer, name=str(path_or_id))

    def chat_text(self, prompt: str) -> str:
        """The model's input for one prompt, as text: the chat template with the system prompt and the prompt."""
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": prompt}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  enable_thinking=False)

    def chat_ids(self, prompt: str) -> list[int]:
        return self.tokenizer(self.chat_text(prompt), add_special_tokens=False).input_ids

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text. Ids past the tokenizer (a checkpoint's embedding is padded beyond it) are dropped."""
        return self.tokenizer.decode([i for i in ids if i < len(self.tokenizer)], skip_special_tokens=False)

    @torch.no_grad()
    def enhance(self, prompts: str | list[str], *, seed: int | None = None) -> list[str]:
        """The rewritten prompts, one per prompt, all decoded in one batch. An empty prompt stays as it is; a reply
        that cleans to nothing falls back to its prompt (logged). seed None: self.seed."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not all(isinstance(p, str) for p in prompts):
            raise TypeError(f"prompts must be a string or a list of strings, got {[type(p).__name__ for p in prompts]}")
        todo = [i for i, p in enumerate(prompts) if p.strip()]
        if not todo:
            return prompts
        replies = generate(self.model, [self.chat_ids(prompts[i]) for i in todo], self.max_new_tokens,
                           temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                           stop_token_ids=self.stop_token_ids, seed=self.seed if seed is None else seed)
        enhanced = list(prompts)
        for i, reply in zip(todo, replies):
            truncated = len(reply) == self.max_new_tokens  # no stop token within the limit
            if truncated:
                logger.warning("the rewrite of prompt %d hit max_new_tokens=%d: cut after its last full sentence",
                               i, self.max_new_tokens)
            text = clean_output(self.decode(reply), truncated=truncated,
                                special_tokens=self.tokenizer.all_special_tokens)
            if not text:
                logger.warning("the rewrite of prompt %d is empty: using the prompt as given (%r)", i, prompts[i])
            enhanced[i] = text or prompts[i]
        return enhanced

    def __repr__(self) -> str:
        return f"PromptEnhancer({self.name or type(self.model).__name__}, device={self.model.device})"


def load_enhancer(enhance_prompt, device=None):
    """True: PromptEnhancer.from_pretrained() (DEFAULT_ENHANCER_ID). A str or path: a Qwen3.5 checkpoint (local
    folder or hub id); "tiny-random": tiny_enhancer(), random weights, for tests. device: where it runs (None: CUDA
    when available). What core/prompt_enhancer.resolve_enhancer loads names with (registered by
    pipelines/__init__.py)."""
    if enhance_prompt is True:
        return PromptEnhancer.from_pretrained(DEFAULT_ENHANCER_ID, device=device)
    if enhance_prompt == TINY_ENHANCER_ID:
        return tiny_enhancer(device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return PromptEnhancer.from_pretrained(os.fspath(enhance_prompt), device=device)


def tiny_enhancer(seed: int = 0, max_new_tokens: int = 8, device="cpu"):
    """A PromptEnhancer on a tiny random Qwen3.5 (fp32), greedy, with a one-line system prompt. Its rewrites are
    gibberish from random weights. On a CPU its Triton kernels need TRITON_INTERPRET=1."""
    tokenizer = tiny_qwen35_tokenizer()
    model = FastQwen35ForCausalLM.from_transformers(tiny_qwen35(len(tokenizer), seed), device=device)
    return PromptEnhancer(model, tokenizer, system_prompt=TINY_ENHANCER_SYSTEM_PROMPT, max_new_tokens=max_new_tokens,
                          temperature=0.0, name=TINY_ENHANCER_ID)
