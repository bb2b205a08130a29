"""Batched generation with FastQwen35ForCausalLM.

Prompts are prefilled one at a time into their cache slots (no padding); then each step decodes one token for every
sequence: tokens [B] -> model.decode -> logits [B, V] fp32 -> sample -> tokens, in place. On CUDA that whole step
(every layer, lm_head and sampling) is one captured CUDA graph, replayed once per new token; the host reads the B new
tokens (one small copy a step, overlapped with the next step: TokenReader) to stream them and check stop tokens.
Finished sequences keep running in the batch, so the shapes stay static; their tokens are dropped. The step after
the one where every sequence stopped has already been queued: it runs, and its tokens are dropped. On the CPU the
same step runs eagerly, one at a time.

The cache, token buffer, random generator and graphs live in a Decoder kept on the model, so a later call with the
same batch size and cache length replays the graphs it captured. The cache length defaults to the positions written
(longest prompt + max_new_tokens - 1) rounded up to CACHE_LEN_STEP, so calls with similar lengths share one.
"""

from dataclasses import dataclass

import torch

from .model import FastQwen35ForCausalLM

CACHE_LEN_STEP = 256


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (top_k, top_p then unused); top_k 0 and top_p 1 are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """logits: [B, V] fp32 -> tokens [B] int64, on the device and without host synchronization. Temperature, then
    top-k, then top-p (the smallest set of most likely tokens whose probability reaches top_p), then a draw from
    the remaining distribution as an exponential race: argmax(p / E), E ~ Exp(1)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= sampling.top_p  # the tokens before it already reach top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=-1)


class Decoder:
    """Static decoding state for `batch` sequences of up to `max_len` tokens: the hybrid cache, the token buffer
    (each step's input, then its output) and its reader, a random generator and, with CUDA graphs, one graph per
    Sampling."""

    def __init__(self, model: FastQwen35ForCausalLM, batch: int, max_len: int, use_graph: bool):
        self.model = model
        self.key = (batch, max_len, use_graph)
        self.use_graph = use_graph
        self.cache = model.new_cache(batch, max_len)
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=model.device)  # [B]
        self.generator = torch.Generator(model.device)
        self.graphs: dict[Sampling, torch.cuda.CUDAGraph] = {}
        self.reader = TokenReader(self.tokens)

    def _step(self, sampling: Sampling):
        self.tokens.copy_(sample(self.model.decode(self.tokens, self.cache), sampling, self.generator))

    def prepare(self, sampling: Sampling):
        """Captures the step for `sampling` if it runs as a graph and has none yet. Call before prefill: warm-up
        and capture run real steps on the cache."""
        if not self.use_graph or sampling in self.graphs:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compiles the Triton kernels and settles the allocator outside the capture
            for _ in range(2):
                self.cache.lengths.zero_()  # each warm-up step writes K/V at position 0: a 1-long cache fits
                self._step(sampling)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if sampling.temperature > 0:
            graph.register_generator_state(self.generator)  # replays advance this generator, not the default one
        with torch.cuda.graph(graph):
            self._step(sampling)
        self.graphs[sampling] = graph

    def step(self, sampling: Sampling):
        if self.use_graph:
            self.graphs[sampling].replay()
        else:
            self._step(sampling)


class TokenReader:
    """Brings each step's tokens [B] to the host without stalling the device: fetch(step) queues a copy into one of
    two host buffers (pinned, on CUDA) right behind the step, so the host can queue step + 1 before read(step) waits
    for that copy (a blocking .tolist() would leave the GPU idle while the host reads, checks stops and launches the
    next graph). On the CPU the copy is immediate."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens
        self.host = torch.empty((2, tokens.numel()), dtype=tokens.dtype, pin_memory=tokens.is_cuda)
        self.copied = [torch.cuda.Event(), torch.cuda.Event()] if tokens.is_cuda else None

    def fetch(self, step: int):
        self.host[step % 2].copy_(self.tokens, non_blocking=True)
        if self.copied:
            self.copied[step % 2].record()

    def read(self, step: int) -> list[int]:
        """The tokens fetched for `step`; call before fetch(step + 2), which reuses its buffer."""
        if self.copied:
            self.copied[step % 2].synchronize()
        return self.host[step % 2].tolist()


def decoder_for(model: FastQwen35ForCausalLM, batch: int, max_len: int, cuda_graph: bool) -> Decoder:
    """The model's Decoder for this shape; only the latest is kept (a cache at the real sizes takes gigabytes)."""
    key = (batch, max_len, cuda_graph and model.device.type == "cuda")
    if getattr(model, "_decoder", None) is None or model._decoder.key != key:
        model._decoder = None  # the only reference: frees the old cache and graphs before allocating the new ones
        model._decoder = Decoder(model, *key)
    return model._decoder


def cache_positions(prompt_len: int, max_new_tokens: int) -> int:
    """Cache positions a sequence writes: its prompt, then every new token but the last (the first comes from
    prefill's logits, the last is never fed back)."""
    return prompt_len + max_new_tokens - 1


def _check_args(model, prompts, max_new_tokens, temperature, top_p, top_k, max_cache_len):
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
    vocab = model.embed_tokens.shape[0]
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab}): min {min(prompt)}, max {max(prompt)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be at least 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p}: must be in (0, 1]")
    if top_k < 0:
        raise ValueError(f"top_k={top_k}: must be >= 0 (0 is off)")
    longest = max(len(prompt) for prompt in prompts)
    if max_cache_len is not None and cache_positions(longest, max_new_tokens) > max_cache_len:
        raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens={max_new_tokens} - 1 = "
                         f"{cache_positions(longest, max_new_tokens)} cache positions needed, more than "
                         f"max_cache_len={max_cache_len}")


@torch.no_grad()
def generate(
    model: FastQwen35ForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids=(),
    seed: int | None = None,
    stream=None,
    cuda_graph: bool = True,
    max_cache_len: int | None = None,
) -> list[list[int]]:
    """Generates up to max_new_tokens for each prompt (token ids), all in one batch. A sequence ends at its first
    token in stop_token_ids (not included in its output). Greedy when temperature == 0; otherwise sampling on the
    device with a generator seeded from `seed` (None: a random seed). stream(step, new_tokens) is called after each
    step with one entry per prompt: the new token, or None for a sequence that has finished. cuda_graph: replay the
    step from a CUDA graph (CUDA only). max_cache_len: the cache length, at least longest prompt + max_new_tokens - 1
    (the default, rounded up to CACHE_LEN_STEP). Returns the new tokens of each prompt."""
    _check_args(model, prompts, max_new_tokens, temperature, top_p, top_k, max_cache_len)
    longest = max(len(prompt) for prompt in prompts)
    if max_cache_len is None:
        max_cache_len = -(-cache_positions(longest, max_new_tokens) // CACHE_LEN_STEP) * CACHE_LEN_STEP
    sampling = Sampling(float(temperature), int(top_k), float(top_p)) if temperature > 0 else Sampling()
    decoder = decoder_for(model, len(prompts), max_cache_len, cuda_graph)
    decoder.prepare(sampling)
    if seed is None:
        decoder.generator.seed()
    else:
        decoder.generator.manual_seed(seed)
    logits = torch.stack([model.prefill(torch.tensor(prompt, dtype=torch.int64), decoder.cache, slot)
                          for slot, prompt in enumerate(prompts)])  # [B, V] fp32
    decoder.tokens.copy_(sample(logits, sampling, decoder.generator))

    stop = set(stop_token_ids)
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    decoder.reader.fetch(0)
    for step in range(max_new_tokens):
        if step + 1 < max_new_tokens:  # queue the next step before waiting for this one's tokens
            decoder.step(sampling)
            decoder.reader.fetch(step + 1)
        new_tokens = decoder.reader.read(step)
        for i, token in enumerate(new_tokens):
            if done[i] or token in stop:
                done[i] = True
                new_tokens[i] = None
            else:
                outputs[i].append(token)
        if stream is not None:
            stream(step, new_tokens)
        if all(done):
            break
    return outputs
