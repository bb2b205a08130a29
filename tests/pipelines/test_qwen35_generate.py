"""generate(): greedy tokens equal transformers' generate, per-sequence stop tokens, streaming, seeded sampling, the
sampler's top-k / top-p, argument and cache-length errors. GPU: the CUDA-graph loop against the eager one."""

import gc
import weakref

import pytest
import torch
from test_qwen35_model import TINY_TEXT, real_width_hf, tiny_hf

from qwen_image_fast.pipelines.qwen35 import FastQwen35ForCausalLM, generate
from qwen_image_fast.pipelines.qwen35.generate import Decoder, Sampling, sample

PROMPTS = [[5, 17, 88, 3], [40, 2, 99, 61, 7, 12, 30, 71, 9]]


@pytest.fixture(scope="module")
def models():
    hf = tiny_hf()
    return hf, FastQwen35ForCausalLM.from_transformers(hf)


def hf_greedy(hf, prompts, max_new_tokens):
    """transformers' batched greedy generate, prompts left-padded with an attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                      pad_token_id=0, eos_token_id=None)
    return out[:, width:].tolist()


def test_greedy_matches_transformers_generate(models):
    hf, fast = models
    assert generate(fast, PROMPTS, 8) == hf_greedy(hf, PROMPTS, 8)


def test_stop_tokens_and_stream(models):
    _, fast = models
    full = generate(fast, PROMPTS, 5)
    stop = full[0][2]  # sequence 0 stops before its third token
    assert stop not in full[1], "pick prompts whose second sequence does not hit the stop token"
    calls = []
    out = generate(fast, PROMPTS, 5, stop_token_ids=[stop], stream=lambda step, new: calls.append((step, new)))
    assert out == [full[0][:2], full[1]]
    assert [step for step, _ in calls] == list(range(5))
    assert [new[0] for _, new in calls] == full[0][:2] + [None] * 3
    assert [new[1] for _, new in calls] == full[1]


def test_all_stopped_ends_early(models):
    _, fast = models
    full = generate(fast, PROMPTS, 4)
    calls = []
    out = generate(fast, PROMPTS, 4, stop_token_ids=[full[0][0], full[1][1]], stream=lambda *a: calls.append(a))
    assert out == [[], full[1][:1]]
    assert len(calls) == 2  # step 1 finished both sequences


def test_seeded_sampling(models):
    _, fast = models
    kwargs = dict(temperature=1.5, top_k=50, top_p=0.95)
    first = generate(fast, PROMPTS, 3, seed=3, **kwargs)
    assert generate(fast, PROMPTS, 3, seed=3, **kwargs) == first
    assert generate(fast, PROMPTS, 3, seed=4, **kwargs) != first
    assert generate(fast, PROMPTS, 3, temperature=1.0, top_k=1, seed=5) == generate(fast, PROMPTS, 3)


def test_sample_top_k_top_p():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).log_softmax(-1).expand(4000, 4).contiguous()  # p = .64 .24 .09 .03
    counts = lambda s: torch.bincount(sample(logits, s, gen), minlength=4).tolist()  # noqa: E731
    assert counts(Sampling(1.0, top_k=2))[2:] == [0, 0]
    assert counts(Sampling(1.0, top_p=0.6)) == [4000, 0, 0, 0]  # the first token alone reaches 0.6
    assert counts(Sampling(1.0, top_p=0.7))[2:] == [0, 0]
    full = counts(Sampling(1.0))
    assert all(c > 0 for c in full) and abs(full[0] / 4000 - 0.64) < 0.04
    assert counts(Sampling()) == [4000, 0, 0, 0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[1], []]), r"prompts\[1\] is empty"),
    (dict(prompts=[[1, TINY_TEXT["vocab_size"]]]), r"prompts\[0\] has token ids outside \[0, 101\)"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(max_cache_len=11), r"9 tokens\) \+ max_new_tokens=4 - 1 = 12 cache positions needed, more than "
                             r"max_cache_len=11"),
])
def test_argument_errors(models, kwargs, message):
    _, fast = models
    kwargs = {"prompts": PROMPTS, "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(fast, kwargs.pop("prompts"), kwargs.pop("max_new_tokens"), **kwargs)


def test_exact_cache_fit_and_decoder_reuse(models):
    _, fast = models
    out = generate(fast, PROMPTS, 4, max_cache_len=12)  # 9 + 4 - 1: the last decode step writes position 11
    decoder = fast._decoder
    assert generate(fast, PROMPTS, 4, max_cache_len=12) == out and fast._decoder is decoder
    assert out == generate(fast, PROMPTS, 4)  # default cache length: 256
    assert generate(fast, [[7]], 1, max_cache_len=1) == generate(fast, [[7]], 1)  # prefill alone fills the cache


def test_old_decoder_freed_before_the_new_one_is_built(models, monkeypatch):
    _, fast = models
    generate(fast, PROMPTS, 2)
    old = weakref.ref(fast._decoder)
    alive_at_init = []
    init = Decoder.__init__

    def checked_init(self, *args):
        gc.collect()
        alive_at_init.append(old() is not None)
        init(self, *args)

    monkeypatch.setattr(Decoder, "__init__", checked_init)
    generate(fast, PROMPTS, 2, max_cache_len=64)  # a new cache length: a new Decoder
    assert alive_at_init == [False]


@pytest.mark.gpu
def test_cuda_graph_matches_eager_on_gpu():
    fast = FastQwen35ForCausalLM.from_transformers(real_width_hf())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, fast.config.vocab_size, (n,), generator=gen).tolist() for n in (23, 140, 7)]
    eager = generate(fast, prompts, 24, cuda_graph=False)
    graphed = generate(fast, prompts, 24)
    assert graphed == eager
    assert fast._decoder.use_graph and fast._decoder.graphs
    assert generate(fast, prompts, 24) == eager  # replays the captured graph
    sampled = [generate(fast, prompts, 16, temperature=0.8, top_p=0.9, seed=7) for _ in range(2)]
    assert sampled[0] == sampled[1]
    # the tokens generate reads back (overlapped with the next step) are the step's own: a hand-run greedy chain
    cache = fast.new_cache(1, 64)
    chain = [fast.prefill(torch.tensor(prompts[2]), cache, 0).argmax().item()]
    for _ in range(11):
        chain.append(fast.decode(torch.tensor(chain[-1:], device="cuda"), cache)[0].argmax().item())
    assert generate(fast, prompts[2:], 12, max_cache_len=64) == [chain]
